//! `csd rm`: delete a table or one partition (`table/partition`), on every node given.

use csd_client::{Error, Result};
use csd_protocol::StatusCode;

use super::ClientCreds;

#[derive(clap::Args)]
pub(crate) struct RmArgs {
    /// `table` or `table/partition`.
    target: String,
    /// Node URL (repeat for a partition kept on several nodes: the delete must reach
    /// every copy, so it is refused, nothing deleted, while any of them is out of reach).
    #[arg(long = "node", default_value = "grpc://127.0.0.1:50051")]
    nodes: Vec<String>,
    #[command(flatten)]
    creds: ClientCreds,
}

pub(crate) async fn run(args: RmArgs) -> Result<()> {
    let RmArgs {
        target,
        nodes,
        creds,
    } = args;
    let (table, partition) = match target.split_once('/') {
        Some((t, p)) => (t, Some(p)),
        None => (target.as_str(), None),
    };
    // Every node first: a copy left on a node out of reach would come back with it.
    let mut clients = Vec::new();
    for n in &nodes {
        clients.push(creds.connect(n).await?);
    }
    if let [one] = clients.as_slice() {
        let n = one.delete(table, partition).await?;
        println!("deleted {target} ({n} objects)");
        return Ok(());
    }
    let mut deleted = 0;
    for c in &clients {
        match c.delete(table, partition).await {
            Ok(n) => {
                println!("deleted {target} on {} ({n} objects)", c.url());
                deleted += 1;
            }
            Err(e) if e.status_code() == StatusCode::NotFound => {}
            Err(e) => {
                return Err(Error::NodeStep {
                    context: format!(
                        "deleting {target} on {} failed after {deleted} of the nodes deleted \
                         it (run the same command again once it answers)",
                        c.url()
                    ),
                    source: e,
                });
            }
        }
    }
    if deleted == 0 {
        return Err(Error::Runtime(csd_protocol::Error::NotFound(format!(
            "{target} on none of the {} nodes given",
            nodes.len()
        ))));
    }
    Ok(())
}
