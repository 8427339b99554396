//! All 22 TPC-H queries give the same answer through pushdown (and through the
//! range-read baseline) as DataFusion on the same data locally, on 1 and 3 nodes.

use std::sync::Arc;

use csd_protocol::node_client::NodeClient;
use csd_query_pushdown::{Parallelism, SqlOperator};
use csd_runtime::config::{ByteSize, NodeConfig};
use csd_runtime::node::{self, RunningNode};
use csd_runtime::operator::OperatorRegistry;
use csd_runtime::table::ParquetOptions;
use csd_testbed::tpch;
use datafusion::prelude::SessionContext;

use crate::{assert_same, nodes, register_local, sessions};

/// Scale factor of the default suite (`CSD_TPCH_SF` overrides, e.g. 0.1).
pub(crate) fn scale() -> f64 {
    std::env::var("CSD_TPCH_SF")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0.01)
}

pub(crate) fn local(scale: f64) -> SessionContext {
    let ctx = SessionContext::new();
    for t in tpch::TABLES {
        let (schema, batches) = tpch::generate(t, scale, 1, 1).unwrap();
        register_local(&ctx, t, schema, batches);
    }
    ctx
}

async fn all_queries(node_count: usize, parts_per_node: usize) {
    let (nodes, clients) = nodes(node_count).await;
    all_queries_on(&nodes, &clients, parts_per_node).await;
}

async fn all_queries_on(nodes: &[RunningNode], clients: &[NodeClient], parts_per_node: usize) {
    let sf = scale();
    tpch::load(clients, sf, parts_per_node, |_, _| {})
        .await
        .unwrap();
    let local = local(sf);
    let (on, off) = sessions(nodes).await;
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
    // With several partitions per node, join-key filters went to each node once and
    // its fragments named them.
    if parts_per_node > 1 {
        for c in clients {
            let a = c.stats().await.unwrap().attachments;
            assert!(a.received > 0 && a.used > a.received, "{a:?}");
            assert_eq!(a.missing, 0, "{a:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tpch_one_node() {
    all_queries(1, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tpch_three_nodes() {
    all_queries(3, 2).await;
}

/// Fragments split into two streams per object (small row groups, no size
/// threshold): partial states merged at the node, key filters under the partial
/// aggregates of both streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tpch_fragments_in_two_streams() {
    let op = SqlOperator::new().with_parallelism(Parallelism {
        streams: 2,
        split_min_bytes: 0,
    });
    let node = node::start_with(
        &NodeConfig {
            device: "emulated:mem".into(),
            capacity: ByteSize::mib(512),
            listen: "127.0.0.1:0".into(),
            cpus: 2,
            parquet: ParquetOptions {
                row_group_rows: 2048,
                page_rows: 512,
                ..ParquetOptions::default()
            },
            ..NodeConfig::default()
        },
        OperatorRegistry::new().with(Arc::new(op)),
    )
    .await
    .unwrap();
    let client = NodeClient::connect(&node.url).await.unwrap();
    let nodes = [node];
    all_queries_on(&nodes, std::slice::from_ref(&client), 2).await;

    // The split happened: Q1's partial aggregate read the node's two lineitem
    // partitions as one fragment, in two streams.
    let (on, _) = sessions(&nodes).await;
    let run = on.run(tpch::query(1).unwrap()).await.unwrap();
    let streams: Vec<usize> = run
        .node_runs
        .iter()
        .map(|r| {
            r.report
                .details::<csd_query_pushdown::wire::details::SqlDetails>()
                .map_or(0, |d| d.streams)
        })
        .collect();
    assert_eq!(streams, [2]);
}
