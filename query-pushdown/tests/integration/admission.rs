//! Admission control end to end: fragments a node pushes back are evaluated on the
//! compute tier with the same answer, and an overloaded `--cpus 1` node answers
//! every one of many concurrent queries correctly, within its memory budget.

use std::time::Duration;

use csd_protocol::NodeStats;
use csd_protocol::node_client::NodeClient;
use csd_query_pushdown::{Cluster, SessionOptions};
use csd_runtime::admission::Policy;
use csd_runtime::config::{ByteSize, NodeConfig};
use csd_testbed::tpch;
use datafusion::prelude::SessionContext;

use crate::{assert_same, canonical, register_local, sql_node_with};

const SF: f64 = 0.01;
const QUERIES: [u32; 8] = [1, 3, 5, 6, 12, 14, 18, 19];

fn local() -> SessionContext {
    let ctx = SessionContext::new();
    for t in tpch::TABLES {
        let (schema, batches) = tpch::generate(t, SF, 1, 1).unwrap();
        register_local(&ctx, t, schema, batches);
    }
    ctx
}

async fn stats(url: &str) -> NodeStats {
    NodeClient::connect(url)
        .await
        .unwrap()
        .stats()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pushed_back_fragments_give_the_same_answers() {
    let node = sql_node_with(NodeConfig {
        cpus: 1,
        policy: Policy::Never,
        ..NodeConfig::default()
    })
    .await;
    let client = NodeClient::connect(&node.url).await.unwrap();
    tpch::load(&[client], SF, 2, |_, _| {}).await.unwrap();
    let local = local();
    let cluster = Cluster::connect(std::slice::from_ref(&node.url))
        .await
        .unwrap();
    let on = cluster.session(SessionOptions::default()).await.unwrap();
    for (_, sql) in tpch::QUERIES {
        assert_same(&local, &on, sql).await;
    }
    let run = on.run(tpch::query(1).unwrap()).await.unwrap();
    let plan = run.plan_with_metrics();
    assert!(
        plan.contains("pushed_back (this node pushes every operator back"),
        "EXPLAIN ANALYZE names the pushed-back partitions:\n{plan}"
    );
    let s = stats(&node.url).await;
    assert_eq!(s.admission.counters.admitted, 0, "{s:?}");
    assert!(s.admission.counters.pushed_back > 22);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_too_big_for_memory_is_pushed_back_not_failed() {
    // 17 MiB: below the operator's smallest estimate (16 MiB + 4x a row group).
    let node = sql_node_with(NodeConfig {
        cpus: 1,
        memory: ByteSize::mib(17),
        metrics_listen: Some("127.0.0.1:0".into()),
        ..NodeConfig::default()
    })
    .await;
    let client = NodeClient::connect(&node.url).await.unwrap();
    tpch::load(&[client], SF, 1, |_, _| {}).await.unwrap();
    let local = local();
    let on = Cluster::connect(std::slice::from_ref(&node.url))
        .await
        .unwrap()
        .session(SessionOptions::default())
        .await
        .unwrap();
    let sql = tpch::query(1).unwrap();
    assert_same(&local, &on, sql).await;
    let plan = on.run(sql).await.unwrap().plan_with_metrics();
    assert!(plan.contains("more than the node's whole budget"), "{plan}");
    // The Prometheus endpoint counts them.
    let text = http_get(node.metrics_addr.unwrap(), "/metrics").await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let pushed: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("csd_pushed_back_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no csd_pushed_back_total in\n{text}"));
    assert!(pushed >= 2.0, "{text}");
    assert!(text.contains("# TYPE csd_queue_delay_seconds_sum counter"));
    assert!(
        http_get(node.metrics_addr.unwrap(), "/nope")
            .await
            .starts_with("HTTP/1.1 404")
    );
}

async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

/// Many concurrent clients against one `--cpus 1` node with a tight queueing
/// target: every query returns the right answer, none fails, some work is pushed
/// back, and reserved memory never passes the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overloaded_node_answers_every_query_correctly() {
    let node = sql_node_with(NodeConfig {
        cpus: 1,
        memory: ByteSize::mib(256),
        queue_target_ms: 5.0,
        ..NodeConfig::default()
    })
    .await;
    let client = NodeClient::connect(&node.url).await.unwrap();
    tpch::load(&[client], SF, 2, |_, _| {}).await.unwrap();
    let local = std::sync::Arc::new(local());
    let mut expected = std::collections::HashMap::new();
    for q in QUERIES {
        let sql = tpch::query(q).unwrap();
        let b = local.sql(sql).await.unwrap().collect().await.unwrap();
        expected.insert(q, canonical(&b));
    }
    let expected = std::sync::Arc::new(expected);
    let clients = 12;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let mut tasks = Vec::new();
    for c in 0..clients {
        let url = node.url.clone();
        let expected = expected.clone();
        tasks.push(tokio::spawn(async move {
            let on = Cluster::connect(&[url])
                .await
                .unwrap()
                .session(SessionOptions {
                    target_partitions: Some(2),
                    ..SessionOptions::default()
                })
                .await
                .unwrap();
            let mut done = 0;
            for k in 0..QUERIES.len() {
                if tokio::time::Instant::now() > deadline {
                    break;
                }
                let q = QUERIES[(c + k) % QUERIES.len()];
                let run = on
                    .run(tpch::query(q).unwrap())
                    .await
                    .unwrap_or_else(|e| panic!("client {c} Q{q} failed: {e}"));
                assert_eq!(canonical(&run.batches), expected[&q], "client {c} Q{q}");
                done += 1;
            }
            done
        }));
    }
    // Watch reserved and used memory while they run.
    let finished = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = tokio::spawn({
        let url = node.url.clone();
        let finished = finished.clone();
        async move {
            let (mut reserved, mut used) = (0u64, 0u64);
            let c = NodeClient::connect(&url).await.unwrap();
            while !finished.load(std::sync::atomic::Ordering::Relaxed) {
                let s = c.stats().await.unwrap();
                reserved = reserved.max(s.admission.memory_reserved);
                used = used.max(s.operator_memory_used);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (reserved, used)
        }
    });
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    finished.store(true, std::sync::atomic::Ordering::Relaxed);
    let (reserved, used) = watcher.await.unwrap();
    let budget = 256u64 << 20;
    assert!(
        reserved > 0 && reserved <= budget,
        "reserved peak {reserved}"
    );
    assert!(used <= budget, "used peak {used}");
    let s = stats(&node.url).await;
    let c = &s.admission.counters;
    assert!(total >= clients, "{total} queries ran");
    assert!(c.admitted > 0, "{s:?}");
    assert!(
        c.pushed_back > 0,
        "12 clients on one CPU with a 5 ms target must push some work back: {s:?}"
    );
    assert_eq!(c.rejected, 0, "{s:?}");
    assert_eq!(s.admission.running, 0);
    assert_eq!(s.admission.memory_reserved, 0);
}
