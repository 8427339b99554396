//! Partitions kept on several nodes: one partition however many copies, answers
//! from the others when a node is gone, and tables refused — never answered short —
//! when a partition's every copy may be out of reach or copies disagree.
//!
//! Table `r` has six partitions, each on two of three nodes (partition `i` on nodes
//! `i` and `i + 1`, mod 3); table `once` has one partition per node, kept once.

use std::sync::Arc;

use arrow::array::{ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use csd_protocol::node_client::NodeClient;
use csd_query_pushdown::{Cluster, SessionOptions, Workers};
use datafusion::prelude::SessionContext;

use futures::TryStreamExt;

use crate::{assert_same, canonical, nodes, register_local, sessions_of};

const PARTS: usize = 6;
const ROWS: i64 = 3_000;

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("k", DataType::Int64, false),
        Field::new("s", DataType::Utf8, false),
        Field::new("v", DataType::Float64, false),
    ]))
}

/// Partition `p`'s rows.
fn part(p: usize) -> RecordBatch {
    let ids: Vec<i64> = (0..ROWS).map(|i| p as i64 * ROWS + i).collect();
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from(ids.clone())),
        Arc::new(Int64Array::from_iter_values(ids.iter().map(|i| i % 37))),
        Arc::new(StringArray::from_iter_values(
            ids.iter().map(|i| format!("s{}", i % 11)),
        )),
        Arc::new(Float64Array::from_iter_values(
            ids.iter().map(|i| (i % 101) as f64 / 4.0),
        )),
    ];
    RecordBatch::try_new(schema(), columns).unwrap()
}

async fn put(c: &NodeClient, table: &str, p: &str, copies: u32, b: RecordBatch) {
    c.put_copy(
        table,
        p,
        copies,
        None,
        schema(),
        futures::stream::iter([Ok(b)]),
    )
    .await
    .unwrap();
}

/// `r` on `clients` (two copies of each partition), `once` (one copy each), and
/// both locally.
async fn load(clients: &[NodeClient]) -> SessionContext {
    for p in 0..PARTS {
        for n in [p % 3, (p + 1) % 3] {
            put(&clients[n], "r", &format!("p{p}"), 2, part(p)).await;
        }
    }
    for (n, c) in clients.iter().enumerate() {
        put(c, "once", &format!("p{n}"), 1, part(n)).await;
    }
    let local = SessionContext::new();
    register_local(&local, "r", schema(), (0..PARTS).map(part).collect());
    register_local(&local, "once", schema(), (0..3).map(part).collect());
    local
}

const QUERIES: &[&str] = &[
    "SELECT count(*) AS n, sum(v) AS s FROM r",
    "SELECT k, count(*) AS n, sum(v) AS s FROM r GROUP BY k",
    "SELECT id, s FROM r WHERE v > 24.5 AND k = 3",
    "SELECT * FROM r",
    "SELECT s, max(id) AS m FROM r WHERE id % 7 = 1 GROUP BY s",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn copies_are_one_partition_and_a_lost_node_costs_no_answer() {
    let (mut nodes, clients) = nodes(3).await;
    let local = load(&clients).await;
    let urls: Vec<String> = nodes.iter().map(|n| n.url.clone()).collect();
    let cluster = Cluster::connect(&urls).await.unwrap();
    let tables = cluster.tables().await.unwrap();
    let r = &tables["r"];
    assert_eq!(r.endpoints.len(), PARTS, "six partitions, not twelve");
    assert!(r.endpoints.iter().all(|e| e.replicas.len() == 1));
    let (on, off) = sessions_of(&cluster).await;
    for sql in QUERIES {
        assert_same(&local, &on, sql).await;
        assert_same(&local, &off, sql).await;
    }

    // Node 1 goes away. Sessions made before fail over, pushed fragments and
    // byte-range reads alike; a session made after leaves it out.
    let gone = nodes.remove(1);
    gone.shutdown().await.unwrap();
    for sql in QUERIES {
        assert_same(&local, &on, sql).await;
        assert_same(&local, &off, sql).await;
    }
    let run = on.run(QUERIES[1]).await.unwrap();
    let plan = run.plan_with_metrics();
    assert!(
        plan.contains("(after "),
        "EXPLAIN ANALYZE names the copy that failed:\n{plan}"
    );
    let after = Cluster::connect(&urls).await.unwrap();
    let on_after = after.session(SessionOptions::default()).await.unwrap();
    for sql in QUERIES {
        assert_same(&local, &on_after, sql).await;
    }
    // `once` kept one copy per partition: with a node out it cannot be read whole,
    // and says so instead of answering without that node's rows.
    let e = on_after
        .run("SELECT count(*) FROM once")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("cannot be read whole") && e.contains(&urls[1]),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn copies_that_differ_are_not_replicas() {
    let (nodes, clients) = nodes(2).await;
    put(&clients[0], "d", "p0", 2, part(0)).await;
    put(&clients[1], "d", "p0", 2, part(1)).await;
    let urls: Vec<String> = nodes.iter().map(|n| n.url.clone()).collect();
    let cluster = Cluster::connect(&urls).await.unwrap();
    let on = cluster.session(SessionOptions::default()).await.unwrap();
    let e = on
        .run("SELECT count(*) FROM d")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("partition p0 of table d") && e.contains("not replicas"),
        "{e}"
    );
}

/// The same with the plans' stages on datafusion-distributed workers: the plans
/// they are sent carry each partition's copies, so a node lost after the session
/// was made costs no answer there either.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_workers_a_lost_node_costs_no_answer() {
    let (mut nodes, clients) = nodes(3).await;
    let local = load(&clients).await;
    let urls: Vec<String> = nodes.iter().map(|n| n.url.clone()).collect();
    let (workers, _stop) = crate::distributed::workers(2).await;
    let on = Cluster::connect(&urls)
        .await
        .unwrap()
        .distributed_session(SessionOptions::default(), &Workers::new(workers))
        .await
        .unwrap();
    for sql in QUERIES {
        assert_same(&local, &on, sql).await;
    }
    nodes.remove(1).shutdown().await.unwrap();
    for sql in QUERIES {
        assert_same(&local, &on, sql).await;
    }
}

/// Keeping an answer at the nodes asks a partition's next copy when its node is
/// lost: every partition's answer is kept, none at the lost node, and the kept rows
/// are the query's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kept_answer_is_made_at_another_copy_when_a_node_is_lost() {
    let (mut nodes, clients) = nodes(3).await;
    let local = load(&clients).await;
    let urls: Vec<String> = nodes.iter().map(|n| n.url.clone()).collect();
    let on = Cluster::connect(&urls)
        .await
        .unwrap()
        .session(SessionOptions::default())
        .await
        .unwrap();
    let sql = "SELECT id, s FROM r WHERE v > 24.5 AND k = 3";
    let want = canonical(&local.sql(sql).await.unwrap().collect().await.unwrap());
    assert!(!want.is_empty());
    let gone = nodes.remove(1);
    let gone_url = gone.url.clone();
    gone.shutdown().await.unwrap();
    let kept = on
        .keep(sql, std::time::Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(kept.len(), PARTS, "one reference per partition");
    let mut rows = Vec::new();
    for k in &kept {
        assert_ne!(k.reference.location, gone_url, "{:?}", k.reference);
        let at = NodeClient::connect(&k.reference.location).await.unwrap();
        let batches: Vec<RecordBatch> = at
            .resolve(&k.reference)
            .await
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        rows.extend(batches);
    }
    assert_eq!(canonical(&rows), want);
}
