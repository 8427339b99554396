//! Does a node hold its memory budget? One `csd serve` process (the real CLI, its own
//! process, a file-backed device) with `--memory 256MiB --cpus 1` holds lineitem
//! (3M rows by default); 16 group-by queries arrive at once from a compute tier in
//! this process. The node's resident memory (`VmRSS` of its process, sampled every
//! 5 ms from `/proc`) is held against the budget, per admission policy; with it, how
//! long the longest-waiting request queued at the node and why, and whether every
//! query answered as it does without pushdown.
//!
//! `cargo run --release -p csd-benches --bin memory -- [--rows 3000000] [--memory 256MiB]`
//! (build `csd` first: `cargo build --release -p csd-client`).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use csd_benches::{default_json_path, write_json};
use csd_query_pushdown::{Cluster, CsdSession, SessionOptions};
use csd_runtime::config::ByteSize;
use csd_runtime::node_client::NodeClient;
use csd_runtime::protocol::NodeStats;
use csd_testbed::tpch;
use serde::Serialize;

#[derive(Parser)]
struct Args {
    /// Lineitem rows (about 6M per TPC-H scale factor).
    #[arg(long, default_value_t = 3_000_000)]
    rows: u64,
    /// Lineitem partitions.
    #[arg(long, default_value_t = 2)]
    parts: i32,
    /// The node's `--memory`.
    #[arg(long, default_value = "256MiB")]
    memory: ByteSize,
    /// The node's `--cpus`.
    #[arg(long, default_value_t = 1)]
    cpus: usize,
    /// Queries sent at once.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Admission policies to run, each on a fresh node.
    #[arg(long, value_delimiter = ',', default_value = "adaptive,always")]
    policies: Vec<String>,
    /// Device file directory (default: the target directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// JSON output path.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Group-bys from a few groups to one per order: the hash tables the node builds range
/// from tiny to most of the budget.
const QUERIES: [&str; 5] = [
    "SELECT l_comment, count(*) AS n, sum(l_quantity) AS q FROM lineitem GROUP BY l_comment",
    "SELECT l_orderkey, sum(l_extendedprice * (1 - l_discount)) AS revenue, count(*) AS n FROM lineitem GROUP BY l_orderkey",
    "SELECT l_partkey, avg(l_quantity) AS q, max(l_shipdate) AS last FROM lineitem GROUP BY l_partkey",
    "SELECT l_suppkey, l_returnflag, sum(l_discount) AS d, min(l_comment) AS c FROM lineitem GROUP BY l_suppkey, l_returnflag",
    "SELECT l_returnflag, l_linestatus, sum(l_quantity), sum(l_extendedprice), avg(l_discount), count(*) FROM lineitem GROUP BY l_returnflag, l_linestatus",
];

#[derive(Serialize, Debug)]
struct Run {
    policy: String,
    budget_bytes: u64,
    /// The node's resident memory after loading, before the queries.
    idle_rss_bytes: u64,
    /// Highest resident memory sampled while the queries ran.
    peak_rss_bytes: u64,
    /// The kernel's own high-water mark over the same interval (`VmHWM`, reset first).
    peak_hwm_bytes: Option<u64>,
    /// Highest operator working memory (the node's memory pools) seen in its stats,
    /// polled every 20 ms.
    peak_pool_bytes: u64,
    /// Queries that answered (`mismatched` of them differently from local DataFusion).
    answered: usize,
    failed: Vec<String>,
    mismatched: usize,
    fragments: usize,
    pushed_back: usize,
    /// Longest queueing at the node of a fragment it ran, and its detail.
    max_queue_ms: f64,
    max_queue_patient: bool,
    /// The node's reason for that wait, from its report.
    max_queue_reason: Option<String>,
    /// Longest queueing of a fragment the node queued on its own judgement (not
    /// asked to wait by a saturated compute tier).
    max_queue_unasked_ms: f64,
    wall_s: f64,
    node_queue_delay_max_ms: f64,
}

fn spawn_node(args: &Args, policy: &str, dir: &std::path::Path) -> (std::process::Child, String) {
    let csd = csd_benches::csd_binary();
    let capacity = (args.rows / 3_000_000 + 1) * 1024;
    let mut child = std::process::Command::new(&csd)
        .args(["serve", "--format", "--listen", "127.0.0.1:0"])
        .args(["--cpus", &args.cpus.to_string()])
        .args(["--memory", &args.memory.to_string()])
        .args(["--capacity", &format!("{capacity}MiB")])
        .arg("--device")
        .arg(dir.join("node.img"))
        .args(["--policy", policy])
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "starting {}: {e} (build it: cargo build --release -p csd-client)",
                csd.display()
            )
        });
    let url = csd_benches::node_url(&mut child);
    (child, url)
}

/// Lineitem's partitions: schema and batches of each.
type Parts = Vec<(
    arrow::datatypes::SchemaRef,
    Vec<arrow::record_batch::RecordBatch>,
)>;

async fn run_policy(args: &Args, policy: &str, parts: &Parts, expected: &[Vec<String>]) -> Run {
    let dir = csd_benches::scratch_dir(args.dir.clone()).expect("scratch dir");
    let (mut child, url) = spawn_node(args, policy, dir.path());
    let pid = child.id();
    let client = NodeClient::connect(&url).await.expect("connect");
    for (p, (schema, batches)) in parts.iter().enumerate() {
        client
            .put(
                "lineitem",
                &format!("p{p}"),
                schema.clone(),
                futures::stream::iter(batches.clone().into_iter().map(Ok)),
            )
            .await
            .expect("put");
    }
    let session = Arc::new(
        Cluster::connect(std::slice::from_ref(&url))
            .await
            .expect("cluster")
            .session(SessionOptions::default())
            .await
            .expect("session"),
    );
    // Let the load's buffers settle, then start the high-water mark afresh.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
    let idle = csd_benches::proc_status_bytes(pid, "VmRSS:").unwrap_or(0);
    let rss = csd_benches::RssPeak::start(pid, idle);
    let done = Arc::new(AtomicBool::new(false));
    let pool_peak = Arc::new(AtomicU64::new(0));
    let poller = {
        let (client, pool_peak, done) = (client.clone(), pool_peak.clone(), done.clone());
        tokio::spawn(async move {
            while !done.load(Ordering::Relaxed) {
                if let Ok(s) = client.stats().await {
                    pool_peak.fetch_max(s.operator_memory_used, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..args.concurrency)
        .map(|i| {
            let s: Arc<CsdSession> = session.clone();
            tokio::spawn(
                async move { (i % QUERIES.len(), s.run(QUERIES[i % QUERIES.len()]).await) },
            )
        })
        .collect();
    let mut run = Run {
        policy: policy.to_string(),
        budget_bytes: args.memory.0,
        idle_rss_bytes: idle,
        peak_rss_bytes: 0,
        peak_hwm_bytes: None,
        peak_pool_bytes: 0,
        answered: 0,
        failed: vec![],
        mismatched: 0,
        fragments: 0,
        pushed_back: 0,
        max_queue_ms: 0.0,
        max_queue_patient: false,
        max_queue_reason: None,
        max_queue_unasked_ms: 0.0,
        wall_s: 0.0,
        node_queue_delay_max_ms: 0.0,
    };
    for t in tasks {
        let (q, r) = t.await.expect("task");
        match r {
            Ok(r) => {
                run.answered += 1;
                if csd_benches::canonical_rows(&r.batches) != expected[q] {
                    run.mismatched += 1;
                }
                for e in &r.node_runs {
                    run.fragments += 1;
                    if e.work_pushed_back() {
                        run.pushed_back += 1;
                        continue;
                    }
                    let a = &e.report.admission;
                    if !a.patient {
                        run.max_queue_unasked_ms = run.max_queue_unasked_ms.max(a.queue_ms);
                    }
                    if a.queue_ms > run.max_queue_ms {
                        run.max_queue_ms = a.queue_ms;
                        run.max_queue_patient = a.patient;
                        run.max_queue_reason = a.queue_reason.clone();
                    }
                }
            }
            Err(e) => run.failed.push(e.to_string()),
        }
    }
    run.wall_s = t0.elapsed().as_secs_f64();
    done.store(true, Ordering::Relaxed);
    let peak_rss = rss.stop();
    let _ = poller.await;
    run.peak_pool_bytes = pool_peak.load(Ordering::Relaxed);
    run.peak_rss_bytes = peak_rss;
    run.peak_hwm_bytes = csd_benches::proc_status_bytes(pid, "VmHWM:");
    if let Ok(stats) = client.stats().await {
        let stats: NodeStats = stats;
        run.node_queue_delay_max_ms = stats.admission.counters.queue_delay_us_max as f64 / 1e3;
    }
    let _ = child.kill();
    let _ = child.wait();
    run
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    // What each query answers without pushdown: computed here from the same rows.
    let ctx = datafusion::prelude::SessionContext::new();
    let scale = args.rows as f64 / 6_001_215.0;
    let parts: Parts = (0..args.parts)
        .map(|p| tpch::generate("lineitem", scale, p + 1, args.parts).expect("generate"))
        .collect();
    let all: Vec<_> = parts.iter().flat_map(|(_, b)| b.iter().cloned()).collect();
    let table =
        datafusion::datasource::MemTable::try_new(parts[0].0.clone(), vec![all]).expect("mem");
    ctx.register_table("lineitem", Arc::new(table))
        .expect("register");
    let mut expected = Vec::new();
    for q in QUERIES {
        let b = ctx.sql(q).await.expect("sql").collect().await.expect("run");
        expected.push(csd_benches::canonical_rows(&b));
    }
    drop(ctx);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "{} lineitem rows, node --memory {} --cpus {}, {} group-bys at once",
        args.rows, args.memory, args.cpus, args.concurrency
    );
    println!(
        "{:<9} {:>9} {:>9} {:>9} {:>10} {:>8} {:>11} {:>9} {:>13} {:>7}",
        "policy",
        "idle MiB",
        "peak MiB",
        "HWM MiB",
        "over MiB",
        "answered",
        "pushed back",
        "queue ms",
        "unasked queue",
        "wall s"
    );
    let mut runs = Vec::new();
    for policy in &args.policies {
        let r = run_policy(&args, policy, &parts, &expected).await;
        println!(
            "{:<9} {:>9.0} {:>9.0} {:>9.0} {:>10.0} {:>5}/{:<2} {:>6}/{:<4} {:>9.0} {:>13.0} {:>7.1}{}",
            r.policy,
            mib(r.idle_rss_bytes),
            mib(r.peak_rss_bytes),
            mib(r.peak_hwm_bytes.unwrap_or(0)),
            mib(r.peak_rss_bytes.max(r.peak_hwm_bytes.unwrap_or(0))) - mib(r.budget_bytes),
            r.answered - r.mismatched,
            args.concurrency,
            r.pushed_back,
            r.fragments,
            r.max_queue_ms,
            r.max_queue_unasked_ms,
            r.wall_s,
            if r.max_queue_patient {
                " (longest wait: patient)"
            } else {
                ""
            }
        );
        println!(
            "          operator pools peaked at {:.0} MiB of the {:.0} MiB budget",
            mib(r.peak_pool_bytes),
            mib(r.budget_bytes)
        );
        if let Some(why) = &r.max_queue_reason {
            println!("          longest wait, the node says: {why}");
        }
        for f in &r.failed {
            println!("  failed: {f}");
        }
        runs.push(r);
    }
    let path = args
        .json
        .clone()
        .unwrap_or_else(|| default_json_path("memory"));
    write_json(&path, &runs).expect("write json");
}
