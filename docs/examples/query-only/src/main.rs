//! Queries csd nodes as a service or a training loop would: one SQL query with
//! pushdown, the nodes' figures, and the partitions of a feature dataset if the
//! nodes hold one (`csd put --images … --table images`).

use csd_protocol::node_client::NodeClient;
use csd_query_pushdown::{Cluster, SessionOptions};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let nodes: Vec<String> = std::env::args().skip(1).collect();
    if nodes.is_empty() {
        return Err("usage: csd-query-only NODE_URL…".into());
    }
    let session = Cluster::connect(&nodes)
        .await?
        .session(SessionOptions::default())
        .await?;
    let sql = std::env::var("QUERY").unwrap_or_else(|_| {
        "SELECT l_returnflag, count(*) AS n FROM lineitem WHERE l_quantity < 10 GROUP BY l_returnflag ORDER BY 1".into()
    });
    let run = session.run(&sql).await?;
    println!(
        "{} rows, {} bytes moved from the nodes",
        run.rows(),
        run.bytes_moved
    );
    let mut clients = Vec::new();
    for n in &nodes {
        let c = NodeClient::connect(n).await?;
        let stats = c.stats().await?;
        println!("{n}: {} tables, {} bytes stored", stats.tables, stats.store.bytes_stored);
        clients.push(c);
    }
    if let Ok((sources, samples)) = csd_ml_pushdown::job::sources(&clients, "images").await {
        println!("dataset images: {samples} samples in {} partitions", sources.len());
    }
    Ok(())
}
