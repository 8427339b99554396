//! query-pushdown integration tests: real storage nodes on 127.0.0.1:0 serving the
//! `sql` operator, real Flight traffic, DataFusion on both sides. Every pushdown result
//! is compared with DataFusion running the same query on the same data locally.
#![allow(clippy::unwrap_used)]

mod admission;
mod answer_codec;
mod distributed;
mod edge;
mod explain;
mod faults;
mod gateway;
mod holdout;
mod hostile;
mod late_filters;
mod plans;
mod replicas;
mod running_window;
mod shrink;
mod tpch;
mod whole_at_node;

use std::sync::Arc;

use arrow::array::{Array, RecordBatch};
use arrow::datatypes::{DataType, SchemaRef};
use arrow::util::display::{ArrayFormatter, FormatOptions};
use csd_protocol::node_client::NodeClient;
use csd_query_pushdown::{Cluster, CsdSession, SessionOptions};
use csd_runtime::config::{ByteSize, NodeConfig};
use csd_runtime::node::{self, RunningNode};
use datafusion::datasource::MemTable;
use datafusion::prelude::SessionContext;

/// A node serving SQL pushdown on an emulated in-memory device.
pub async fn sql_node() -> RunningNode {
    sql_node_with(NodeConfig {
        cpus: 2,
        ..NodeConfig::default()
    })
    .await
}

/// [`sql_node`] with other settings (device, capacity and address are set here).
pub async fn sql_node_with(config: NodeConfig) -> RunningNode {
    sql_node_on(NodeConfig {
        device: "emulated:mem".into(),
        capacity: ByteSize::mib(512),
        ..config
    })
    .await
}

/// A node on `config`'s own device and capacity, listening on 127.0.0.1.
pub async fn sql_node_on(config: NodeConfig) -> RunningNode {
    let config = NodeConfig {
        listen: "127.0.0.1:0".into(),
        ..config
    };
    let operators = csd_query_pushdown::registry_with(&config).expect("operator settings");
    node::start_with(&config, operators)
        .await
        .expect("start node")
}

/// `n` nodes and clients to them.
pub async fn nodes(n: usize) -> (Vec<RunningNode>, Vec<NodeClient>) {
    let mut nodes = Vec::new();
    let mut clients = Vec::new();
    for _ in 0..n {
        let node = sql_node().await;
        clients.push(NodeClient::connect(&node.url).await.unwrap());
        nodes.push(node);
    }
    (nodes, clients)
}

/// Sessions over `nodes` with pushdown on and off.
pub async fn sessions(nodes: &[RunningNode]) -> (CsdSession, CsdSession) {
    let urls: Vec<String> = nodes.iter().map(|n| n.url.clone()).collect();
    sessions_of(&Cluster::connect(&urls).await.unwrap()).await
}

/// Sessions over `cluster` with pushdown on and off.
pub async fn sessions_of(cluster: &Cluster) -> (CsdSession, CsdSession) {
    let on = cluster.session(SessionOptions::default()).await.unwrap();
    let off = cluster
        .session(SessionOptions {
            pushdown: false,
            ..SessionOptions::default()
        })
        .await
        .unwrap();
    (on, off)
}

/// Registers `batches` as a local in-memory table of `ctx`.
pub fn register_local(
    ctx: &SessionContext,
    name: &str,
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
) {
    let t = MemTable::try_new(schema, vec![batches]).unwrap();
    ctx.register_table(name, Arc::new(t)).unwrap();
}

/// A result as sorted rows of text (floats to 10 significant digits), so that two
/// correct executions compare equal whatever order equal-ranked rows come in.
pub fn canonical(batches: &[RecordBatch]) -> Vec<String> {
    let opts = FormatOptions::default().with_null("NULL");
    let mut rows = Vec::new();
    for b in batches {
        let fmts: Vec<_> = b
            .columns()
            .iter()
            .map(|c| {
                (
                    c.data_type().clone(),
                    ArrayFormatter::try_new(c.as_ref(), &opts).unwrap(),
                    c.clone(),
                )
            })
            .collect();
        for r in 0..b.num_rows() {
            let cells: Vec<String> = fmts
                .iter()
                .map(|(t, f, c)| match t {
                    DataType::Float64 | DataType::Float32 if !c.is_null(r) => {
                        let v: f64 = f.value(r).to_string().parse().unwrap();
                        format!("{v:.10e}")
                    }
                    _ => f.value(r).to_string(),
                })
                .collect();
            rows.push(cells.join(" | "));
        }
    }
    rows.sort();
    rows
}

/// Runs `sql` locally and through `session`; panics with both answers if they differ.
pub async fn assert_same(local: &SessionContext, session: &CsdSession, sql: &str) -> usize {
    let expected = local.sql(sql).await.unwrap().collect().await.unwrap();
    let run = session
        .run(sql)
        .await
        .unwrap_or_else(|e| panic!("query failed (pushdown {}): {e}\n{sql}", session.pushdown()));
    let (want, got) = (canonical(&expected), canonical(&run.batches));
    assert_eq!(
        want,
        got,
        "results differ (pushdown {}) for\n{sql}\nplan:\n{}",
        session.pushdown(),
        run.plan_with_metrics()
    );
    want.len()
}
