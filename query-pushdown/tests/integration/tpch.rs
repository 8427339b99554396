//! All 22 TPC-H queries give the same answer through pushdown (and through the
//! range-read baseline) as DataFusion on the same data locally, on 1 and 3 nodes.

use csd_query_pushdown::tpch;
use datafusion::prelude::SessionContext;

use crate::{assert_same, nodes, register_local, sessions};

/// Scale factor of the default suite (`CSD_TPCH_SF` overrides, e.g. 0.1).
fn scale() -> f64 {
    std::env::var("CSD_TPCH_SF")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0.01)
}

fn local(scale: f64) -> SessionContext {
    let ctx = SessionContext::new();
    for t in tpch::TABLES {
        let (schema, batches) = tpch::generate(t, scale, 1, 1).unwrap();
        register_local(&ctx, t, schema, batches);
    }
    ctx
}

async fn all_queries(node_count: usize, parts_per_node: usize) {
    let sf = scale();
    let (nodes, clients) = nodes(node_count).await;
    tpch::load(&clients, sf, parts_per_node, |_, _| {})
        .await
        .unwrap();
    let local = local(sf);
    let (on, off) = sessions(&nodes).await;
    let mut nonempty = 0;
    for (n, sql) in tpch::QUERIES {
        let rows = assert_same(&local, &on, sql).await;
        assert_eq!(assert_same(&local, &off, sql).await, rows, "Q{n}");
        if rows > 0 {
            nonempty += 1;
        }
    }
    // The comparison means something only if the queries return rows.
    assert!(
        nonempty >= 18,
        "only {nonempty} of 22 queries returned rows"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tpch_one_node() {
    all_queries(1, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tpch_three_nodes() {
    all_queries(3, 2).await;
}
