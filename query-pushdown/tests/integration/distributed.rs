//! Pushdown plans on datafusion-distributed workers: real workers serving gRPC on
//! 127.0.0.1, real storage nodes. Every answer is compared with DataFusion running
//! the same query on the same data locally.

use std::time::{Duration, Instant};

use csd_protocol::node_client::Credentials;
use csd_query_pushdown::{Cluster, CsdSession, SessionOptions, WorkerEnv, Workers};
use csd_runtime::node::RunningNode;
use csd_testbed::link::{LinkSpec, ThrottledLink};
use csd_testbed::tpch;
use tokio::sync::oneshot;

use crate::tpch::{local, scale};
use crate::{assert_same, nodes};

/// Workers serving on 127.0.0.1:0; dropping the senders stops them.
pub(crate) async fn workers(n: usize) -> (Vec<String>, Vec<oneshot::Sender<()>>) {
    let mut urls = Vec::new();
    let mut stops = Vec::new();
    for _ in 0..n {
        let env = WorkerEnv::new(Credentials::default(), Some(2)).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        urls.push(format!("grpc://{}", listener.local_addr().unwrap()));
        let (tx, rx) = oneshot::channel::<()>();
        tokio::spawn(csd_query_pushdown::serve_worker_on(env, listener, async {
            let _ = rx.await;
        }));
        stops.push(tx);
    }
    (urls, stops)
}

pub(crate) async fn session_on(nodes: &[RunningNode], workers: &[String]) -> CsdSession {
    let urls: Vec<String> = nodes.iter().map(|n| n.url.clone()).collect();
    Cluster::connect(&urls)
        .await
        .unwrap()
        .distributed_session(
            SessionOptions::default(),
            &Workers::new(workers.iter().cloned()),
        )
        .await
        .unwrap()
}

/// All 22 queries on 3 storage nodes (2 partitions each), with their stages on 2
/// and then 3 workers: the same answers as local DataFusion, and the plans are
/// really cut into stages that ran on the workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tpch_on_two_and_three_workers() {
    let (nodes, clients) = nodes(3).await;
    let sf = scale();
    tpch::load(&clients, sf, 2, |_, _| {}).await.unwrap();
    let local = local(sf);
    let urls: Vec<String> = nodes.iter().map(|n| n.url.clone()).collect();
    let alone = Cluster::connect(&urls)
        .await
        .unwrap()
        .session(SessionOptions::default())
        .await
        .unwrap();
    let mut bytes_alone = std::collections::BTreeMap::new();
    for (q, sql) in tpch::QUERIES {
        bytes_alone.insert(q, alone.run(sql).await.unwrap().bytes_moved);
    }
    let alone_total: u64 = bytes_alone.values().sum();
    let mut totals = Vec::new();
    for n in [2, 3] {
        let mut bytes_on = 0;
        let (urls, _stop) = workers(n).await;
        let session = session_on(&nodes, &urls).await;
        let mut staged = 0;
        let mut grew = Vec::new();
        for (q, sql) in tpch::QUERIES {
            assert_same(&local, &session, sql).await;
            let mut started = Instant::now();
            let mut run = session.run(sql).await.unwrap();
            // A loaded machine (the whole suite on two cores) can keep the workers'
            // metrics past the session's wait for them (then `bytes_moved` counts this
            // process's scans only, once 0 for Q17): the figures come from a rerun.
            if !run.metrics_complete {
                started = Instant::now();
                run = session.run(sql).await.unwrap();
            }
            let took = started.elapsed();
            let plan = run.plan_with_metrics();
            // The scans' counters come back from the workers.
            assert!(
                run.metrics_complete,
                "Q{q}: the workers' metrics never came back"
            );
            assert!(run.bytes_moved > 0, "Q{q}: no bytes counted from the nodes");
            bytes_on += run.bytes_moved;
            // (Not equal: the distributed planner turns Q22's scalar subquery into
            // a join above the anti join, so its build side and filter hold more
            // keys: 1.5x at SF 0.01. A lost key filter moved 5-160x.)
            // Q18 reads its customer table by byte range under a broadcast stage,
            // which on workers reads 2.8x what one process does (48.5 KB against
            // 17.5 KB at SF 0.01, footers cached in both): bounded looser.
            let bound = if q == 18 { 3.0 } else { 2.0 };
            if run.bytes_moved as f64 > bytes_alone[&q] as f64 * bound {
                grew.push(format!(
                    "Q{q}: {} bytes on {n} workers, {} alone",
                    run.bytes_moved, bytes_alone[&q]
                ));
            }
            // No scan sat out its key wait (30 s) for a build side that never
            // published its keys.
            assert!(took < Duration::from_secs(20), "Q{q} took {took:?}");
            if plan.contains("Stage") || plan.contains("Network") {
                staged += 1;
            }
            if q == 3 {
                // A broadcast join's build keys are collected in the join's stage,
                // so the probe-side scan there still gets its filter.
                // (Without it lineitem's survivors of the date filter would come
                // back whole: several times the bytes.)
                assert!(
                    run.bytes_moved as f64 <= bytes_alone[&3] as f64 * 1.2,
                    "Q3: {} bytes on workers, {} alone",
                    run.bytes_moved,
                    bytes_alone[&3]
                );
            }
        }
        assert!(
            staged >= 15,
            "only {staged} of 22 plans were distributed on {n} workers"
        );
        // Join-key filters reach their scans whichever stage the build side runs
        // in (a partitioned join's build side publishes its keys to a worker's key
        // board), so no query moves much more than in one process.
        assert!(grew.is_empty(), "{grew:#?}");
        totals.push(bytes_on);
    }
    println!("bytes from the nodes: alone {alone_total}, on 2 and 3 workers {totals:?}");
    assert!(totals[1] as f64 <= totals[0] as f64 * 1.1, "{totals:?}");
    assert!(
        totals[0] as f64 <= alone_total as f64 * 1.15,
        "{totals:?} vs {alone_total}"
    );
}

/// A worker that goes away while its tasks run (its link cut): the query fails with
/// an error naming what broke, within a bound, and the session answers the next
/// query right on the workers that remain.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_lost_mid_query_fails_the_query_clearly() {
    let (nodes, clients) = nodes(2).await;
    let sf = scale();
    tpch::load(&clients, sf, 2, |_, _| {}).await.unwrap();
    let local = local(sf);
    let (urls, _stop) = workers(2).await;
    // The second worker is reached through a link so slow (50 kbit/s) that its
    // tasks' plans are still arriving when the link is cut.
    let upstream = urls[1].trim_start_matches("grpc://").parse().unwrap();
    let link = ThrottledLink::start(LinkSpec::mbit(0.05, 2_000), upstream)
        .await
        .unwrap();
    let session = session_on(&nodes, &[urls[0].clone(), link.url()]).await;
    let sql = tpch::QUERIES
        .iter()
        .find(|(q, _)| *q == 3)
        .map(|(_, s)| *s)
        .unwrap();
    let started = Instant::now();
    let run = tokio::spawn(async move {
        let r = session.run(sql).await.map(|r| r.rows());
        (r, session)
    });
    while link.counters().up() == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the query sent nothing to the second worker"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let link_url = link.url();
    link.shutdown().await;
    let (result, _session) = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the query ended within 60 s of the worker's loss")
        .unwrap();
    let e = result
        .expect_err("a query whose worker went away fails")
        .to_string();
    println!("the error: {e}");
    // The lost worker is named, though the failure reached this process as text
    // relayed by the worker that read from it.
    assert!(
        e.starts_with(&format!("a worker stopped answering: {link_url} ")),
        "the error says what broke: {e}"
    );
    assert!(started.elapsed() < Duration::from_secs(60));
    // The remaining worker runs the next query right.
    let session = session_on(&nodes, &urls[..1]).await;
    assert_same(&local, &session, sql).await;
}

/// The edge-case queries (NULLs, casts, LIMIT 0, strings, empty results, …) on 2
/// workers equal local DataFusion. A function registered only on the coordinating
/// session (the workers do not have it) is an error that names it, never a wrong
/// answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn edge_cases_on_two_workers() {
    use crate::edge::{QUERIES, put_t, schema};
    let (nodes, clients) = nodes(2).await;
    let local = datafusion::prelude::SessionContext::new();
    let all = put_t(&clients, 5, 2000).await;
    crate::register_local(&local, "t", schema(), all);
    let (urls, _stop) = workers(2).await;
    let session = session_on(&nodes, &urls).await;
    let mut ran = 0;
    for q in QUERIES.iter().filter(|q| !q.contains("twice(")) {
        assert_same(&local, &session, q).await;
        ran += 1;
    }
    assert!(ran >= 20, "{ran}");
    assert_eq!(
        assert_same(&local, &session, "select * from t").await,
        40_000
    );
    let twice = datafusion::logical_expr::create_udf(
        "twice",
        vec![arrow::datatypes::DataType::Int64],
        arrow::datatypes::DataType::Int64,
        datafusion::logical_expr::Volatility::Immutable,
        std::sync::Arc::new(|args: &[datafusion::logical_expr::ColumnarValue]| Ok(args[0].clone())),
    );
    session.ctx.register_udf(twice);
    match session
        .run("select id, twice(id) from t where id % 7 = 0 order by id")
        .await
    {
        Err(e) => {
            println!("twice on workers: {e}");
            assert!(e.to_string().contains("twice"), "{e}")
        }
        // Run where the function is (the coordinator): then it must be right.
        Ok(r) => assert_eq!(r.rows(), 40_000 / 7 + 1),
    }
}
