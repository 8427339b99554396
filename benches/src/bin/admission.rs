//! Admission control under load: one node with `--cpus 1`, an open-loop Poisson
//! stream of TPC-H scan queries (Q1, Q6, Q12, Q14, Q19, all pushed down) offered
//! at 0.5x to 4x the node's measured capacity, then a sudden step from 0.7x to
//! 1.4x. Policies side by side, each on a fresh node holding the same data:
//! always push down, never push down (the node hands every fragment back), and
//! the adaptive policy. Per load: goodput, p50/p99 latency (of all queries and of
//! those the node ran entirely), pushed-back fragments, failures. Writes JSON and
//! an SVG plot of goodput against offered load.
//!
//! `cargo run --release -p csd-benches --bin admission -- [--scale 0.1] [--secs 5]`

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use csd_benches::{default_json_path, write_json};
use csd_query_pushdown::{Cluster, CsdSession, SessionOptions};
use csd_runtime::admission::Policy;
use csd_runtime::config::{ByteSize, NodeConfig};
use csd_runtime::node;
use csd_runtime::node_client::NodeClient;
use csd_runtime::protocol::Compression;
use csd_testbed::tpch;
use serde::Serialize;

#[derive(Parser)]
struct Args {
    /// TPC-H scale factor.
    #[arg(long, default_value_t = 0.1)]
    scale: f64,
    /// Partitions per table.
    #[arg(long, default_value_t = 2)]
    parts: usize,
    /// Seconds per load level.
    #[arg(long, default_value_t = 5.0)]
    secs: f64,
    /// Offered loads, as multiples of the node's capacity.
    #[arg(long, value_delimiter = ',', default_value = "0.5,1,2,3,4")]
    loads: Vec<f64>,
    /// Queueing-delay target of the adaptive policy, milliseconds.
    #[arg(long, default_value_t = 50.0)]
    queue_target_ms: f64,
    /// Queries in the mix.
    #[arg(long, value_delimiter = ',', default_value = "1,6,12,14,19")]
    queries: Vec<u32>,
    /// JSON output path (the SVG goes beside it).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Run each node as a `csd serve` process pinned to these cores (`taskset -c`
    /// list), so that it models a separate machine; run this bench itself under
    /// `taskset` on other cores. Default: nodes in this process.
    #[arg(long)]
    node_cores: Option<String>,
    /// Also write one CSV row per fragment the node ran (policy, load, query,
    /// patient, queueing, estimate, node time): where admitted requests' time went.
    #[arg(long)]
    fragments: Option<PathBuf>,
}

/// A node: in this process, or a pinned `csd serve` child.
enum Node {
    Here(node::RunningNode),
    Child(std::process::Child, tempfile::TempDir),
}

impl Node {
    async fn stop(self) {
        match self {
            Node::Here(n) => n.shutdown().await.expect("shutdown"),
            Node::Child(mut c, _dir) => {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

fn spawn_pinned(cores: &str, policy: Policy, args: &Args) -> (Node, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let csd = csd_benches::csd_binary();
    let mut child = std::process::Command::new("taskset")
        .args(["-c", cores])
        .arg(&csd)
        .args([
            "serve",
            "--format",
            "--listen",
            "127.0.0.1:0",
            "--cpus",
            "1",
        ])
        .args(["--memory", "1GiB", "--capacity"])
        .arg(format!("{}MiB", (2000.0 * args.scale).max(256.0) as u64))
        .arg("--device")
        .arg(dir.path().join("node.img"))
        .args(["--policy", name(policy)])
        .arg("--queue-target-ms")
        .arg(args.queue_target_ms.to_string())
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {} under taskset: {e}", csd.display()));
    let url = csd_benches::node_url(&mut child);
    (Node::Child(child, dir), url)
}

#[derive(Serialize, Clone, Debug)]
struct Level {
    policy: String,
    load: f64,
    offered_qps: f64,
    completed: usize,
    goodput_qps: f64,
    p50_ms: f64,
    p99_ms: f64,
    /// Latency of queries whose fragments all ran at the node.
    admitted_p99_ms: Option<f64>,
    /// p99 of the node's own latency (arrival to last byte, queueing included) of the
    /// requests it admitted on its own judgement: what its admission control bounds.
    admitted_node_p99_ms: Option<f64>,
    /// Fragments the compute tier asked the node to queue (it was saturated itself),
    /// and the node's p99 latency for them.
    patient_fragments: u64,
    patient_node_p99_ms: Option<f64>,
    pushed_back_fragments: u64,
    fragments: u64,
    failed: usize,
}

#[derive(Serialize, Clone, Debug)]
struct Step {
    policy: String,
    /// Largest node queueing delay of a fragment admitted after the step (ms).
    max_queue_ms_after: f64,
    /// From the step to the last fragment (by arrival at the node) whose queueing
    /// exceeded the steady state after the step (its p95 +10% +5 ms); `None`: no
    /// fragment ran at the node late enough to tell.
    settle_ms: Option<f64>,
    failed: usize,
}

#[derive(Serialize)]
struct Report {
    scale: f64,
    capacity_qps: f64,
    unloaded_p99_ms: f64,
    unloaded_node_p99_ms: f64,
    queue_target_ms: f64,
    levels: Vec<Level>,
    steps: Vec<Step>,
}

/// One finished query.
struct Done {
    sql: &'static str,
    started: Duration,
    latency: Duration,
    ok: bool,
    fragments: u64,
    pushed_back: u64,
    /// Per fragment the node ran, from its report.
    frags: Vec<Frag>,
}

/// A fragment the node ran (not pushed back), as its report tells.
struct Frag {
    /// The compute tier asked the node to queue it (that tier was saturated).
    patient: bool,
    /// The node queued it past its bound: handing it back was priced slower.
    kept_for_link: bool,
    /// Queueing the node predicted, ms (NaN: not reported).
    predicted_ms: f64,
    /// Queueing it saw, ms (NaN: not reported).
    queue_ms: f64,
    /// Run time the node estimated, ms.
    estimate_ms: f64,
    /// The node's latency for it, arrival to last byte, ms.
    node_ms: f64,
}

async fn run_one(s: Arc<CsdSession>, sql: &'static str, t0: Instant) -> Done {
    let started = t0.elapsed();
    let r = s.run(sql).await;
    let latency = t0.elapsed() - started;
    match r {
        Ok(run) => {
            let pushed = run
                .node_runs
                .iter()
                .filter(|r| r.work_pushed_back())
                .count() as u64;
            let frags = run
                .node_runs
                .iter()
                .filter(|r| r.pushed_back.is_none())
                .map(|r| {
                    let a = &r.report.admission;
                    Frag {
                        patient: a.patient,
                        kept_for_link: a.kept_for_link,
                        predicted_ms: a.predicted_queue_ms,
                        queue_ms: a.queue_ms,
                        estimate_ms: a.estimate_ms,
                        node_ms: r.report.elapsed_us as f64 / 1e3,
                    }
                })
                .collect();
            Done {
                sql,
                started,
                latency,
                ok: true,
                fragments: run.node_runs.len() as u64,
                pushed_back: pushed,
                frags,
            }
        }
        Err(e) => {
            eprintln!("query failed: {e}");
            Done {
                sql,
                started,
                latency,
                ok: false,
                fragments: 0,
                pushed_back: 0,
                frags: vec![],
            }
        }
    }
}

/// Open-loop Poisson arrivals at `rate` per second for `secs`, cycling the mix;
/// returns every query once all have finished.
async fn offer(
    s: &Arc<CsdSession>,
    mix: &[&'static str],
    rate: f64,
    secs: f64,
    seed: u64,
    t0: Instant,
) -> Vec<Done> {
    let mut gaps = csd_testbed::sql::Poisson::new(rate, seed);
    let mut next = Duration::ZERO;
    let start = t0.elapsed();
    let mut tasks = Vec::new();
    let mut k = 0usize;
    while next.as_secs_f64() < secs {
        let at = start + next;
        if let Some(wait) = at.checked_sub(t0.elapsed()) {
            tokio::time::sleep(wait).await;
        }
        tasks.push(tokio::spawn(run_one(s.clone(), mix[k % mix.len()], t0)));
        k += 1;
        next += gaps.next().unwrap_or(Duration::from_secs_f64(secs));
    }
    let mut out = Vec::new();
    for t in tasks {
        if let Ok(d) = t.await {
            out.push(d);
        }
    }
    out
}

fn pct(v: Vec<f64>, p: f64) -> f64 {
    csd_testbed::report::percentile(&v, p)
}

async fn node_for(policy: Policy, args: &Args) -> (Node, Arc<CsdSession>) {
    let (node, url) = match &args.node_cores {
        Some(cores) => spawn_pinned(cores, policy, args),
        None => {
            let config = NodeConfig {
                device: "emulated:mem".into(),
                capacity: ByteSize::mib((2000.0 * args.scale).max(256.0) as u64),
                listen: "127.0.0.1:0".into(),
                cpus: 1,
                memory: ByteSize::gib(1),
                policy,
                queue_target_ms: args.queue_target_ms,
                ..NodeConfig::default()
            };
            let n = node::start_with(&config, csd_query_pushdown::registry())
                .await
                .expect("start node");
            let url = n.url.clone();
            (Node::Here(n), url)
        }
    };
    let client = NodeClient::connect(&url).await.expect("connect");
    tpch::load(&[client], args.scale, args.parts, |_, _| {})
        .await
        .expect("load");
    let session = Cluster::connect(std::slice::from_ref(&url))
        .await
        .expect("cluster")
        .session(SessionOptions {
            compression: Compression::None,
            ..SessionOptions::default()
        })
        .await
        .expect("session");
    (node, Arc::new(session))
}

fn name(p: Policy) -> &'static str {
    match p {
        Policy::Always => "always",
        Policy::Never => "never",
        Policy::Adaptive => "adaptive",
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let mix: Vec<&'static str> = args
        .queries
        .iter()
        .map(|q| tpch::query(*q).expect("query number"))
        .collect();

    // Capacity and unloaded latency: the mix one at a time on an always-node.
    let (cap_node, s) = node_for(Policy::Always, &args).await;
    let t0 = Instant::now();
    for q in &mix {
        run_one(s.clone(), q, t0).await;
    }
    let mut lat = Vec::new();
    let mut node_lat = Vec::new();
    let mut csv = String::from(
        "policy,load,query,patient,kept_for_link,predicted_ms,queue_ms,estimate_ms,node_ms\n",
    );
    let query_of = |sql: &str| {
        mix.iter()
            .position(|m| *m == sql)
            .map(|i| args.queries[i])
            .unwrap_or(0)
    };
    let rows = |csv: &mut String, policy: &str, load: f64, done: &[Done]| {
        for d in done {
            for f in &d.frags {
                csv.push_str(&format!(
                    "{policy},{load},{},{},{},{:.3},{:.3},{:.3},{:.3}\n",
                    query_of(d.sql),
                    u8::from(f.patient),
                    u8::from(f.kept_for_link),
                    f.predicted_ms,
                    f.queue_ms,
                    f.estimate_ms,
                    f.node_ms
                ));
            }
        }
    };
    for _ in 0..4 {
        for q in &mix {
            let d = run_one(s.clone(), q, t0).await;
            lat.push(d.latency.as_secs_f64());
            node_lat.extend(d.frags.iter().map(|f| f.node_ms));
            rows(&mut csv, "unloaded", 0.0, std::slice::from_ref(&d));
        }
    }
    let mean = lat.iter().sum::<f64>() / lat.len() as f64;
    let capacity = 1.0 / mean;
    let unloaded_p99 = pct(lat.clone(), 0.99) * 1e3;
    let unloaded_node_p99 = pct(node_lat, 0.99);
    drop(s);
    cap_node.stop().await;
    println!(
        "node capacity {capacity:.1} queries/s (mean {:.1} ms unloaded, p99 {unloaded_p99:.1} ms; \
         node's own p99 per request {unloaded_node_p99:.1} ms)",
        mean * 1e3
    );

    let mut levels = Vec::new();
    let mut steps = Vec::new();
    println!(
        "\n{:<9} {:>5} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9} {:>12} {:>7} {:>14}",
        "policy",
        "load",
        "offered",
        "goodput",
        "p50 ms",
        "p99 ms",
        "adm p99",
        "node p99",
        "pushed back",
        "failed",
        "patient (p99)"
    );
    for policy in [Policy::Always, Policy::Never, Policy::Adaptive] {
        let (n, s) = node_for(policy, &args).await;
        let t0 = Instant::now();
        for q in &mix {
            run_one(s.clone(), q, t0).await;
        }
        for (i, &load) in args.loads.iter().enumerate() {
            let rate = load * capacity;
            let done = offer(&s, &mix, rate, args.secs, 42 + i as u64, t0).await;
            rows(&mut csv, name(policy), load, &done);
            let window_end = done.iter().map(|d| d.started).min().unwrap_or_default()
                + Duration::from_secs_f64(args.secs);
            let completed = done
                .iter()
                .filter(|d| d.ok && d.started + d.latency <= window_end)
                .count();
            let lats: Vec<f64> = done
                .iter()
                .filter(|d| d.ok)
                .map(|d| d.latency.as_secs_f64() * 1e3)
                .collect();
            let admitted: Vec<f64> = done
                .iter()
                .filter(|d| d.ok && d.pushed_back == 0 && d.fragments > 0)
                .map(|d| d.latency.as_secs_f64() * 1e3)
                .collect();
            let node: Vec<f64> = done
                .iter()
                .flat_map(|d| d.frags.iter().filter(|f| !f.patient).map(|f| f.node_ms))
                .collect();
            let patient: Vec<f64> = done
                .iter()
                .flat_map(|d| d.frags.iter().filter(|f| f.patient).map(|f| f.node_ms))
                .collect();
            let l = Level {
                policy: name(policy).into(),
                load,
                offered_qps: rate,
                completed,
                goodput_qps: completed as f64 / args.secs,
                p50_ms: pct(lats.clone(), 0.5),
                p99_ms: pct(lats, 0.99),
                admitted_p99_ms: (!admitted.is_empty()).then(|| pct(admitted, 0.99)),
                admitted_node_p99_ms: (!node.is_empty()).then(|| pct(node, 0.99)),
                patient_fragments: patient.len() as u64,
                patient_node_p99_ms: (!patient.is_empty()).then(|| pct(patient, 0.99)),
                pushed_back_fragments: done.iter().map(|d| d.pushed_back).sum(),
                fragments: done.iter().map(|d| d.fragments).sum(),
                failed: done.iter().filter(|d| !d.ok).count(),
            };
            println!(
                "{:<9} {:>4.1}x {:>8.1} {:>8.1} {:>9.1} {:>9.1} {:>9} {:>9} {:>5}/{:<6} {:>7} {:>14}",
                l.policy,
                l.load,
                l.offered_qps,
                l.goodput_qps,
                l.p50_ms,
                l.p99_ms,
                l.admitted_p99_ms
                    .map(|v| format!("{v:.1}"))
                    .unwrap_or_else(|| "-".into()),
                l.admitted_node_p99_ms
                    .map(|v| format!("{v:.1}"))
                    .unwrap_or_else(|| "-".into()),
                l.pushed_back_fragments,
                l.fragments,
                l.failed,
                l.patient_node_p99_ms
                    .map(|v| format!("{} ({v:.0} ms)", l.patient_fragments))
                    .unwrap_or_else(|| "-".into()),
            );
            levels.push(l);
        }
        // The step: 0.7x, then suddenly 1.4x.
        let half = args.secs / 2.0;
        let before = offer(&s, &mix, 0.7 * capacity, half, 7, t0);
        let before = before.await;
        let step_at = t0.elapsed();
        let after = offer(&s, &mix, 1.4 * capacity, half, 8, t0).await;
        // Fragments by the time they reached the node (query end - node time).
        let mut late: Vec<(Duration, f64)> = after
            .iter()
            .flat_map(|d| {
                // Those the node admitted on its own judgement (patient ones aside).
                d.frags
                    .iter()
                    .filter(|f| !f.patient && !f.queue_ms.is_nan())
                    .map(move |f| {
                        let at_node = Duration::from_secs_f64(f.node_ms / 1e3);
                        ((d.started + d.latency).saturating_sub(at_node), f.queue_ms)
                    })
            })
            .filter(|x| x.0 >= step_at)
            .collect();
        late.sort_by_key(|x| x.0);
        if args.fragments.is_some() {
            // The step's fragments by arrival: "step-POLICY,ms after the step,,,,,queue".
            for (at, q) in &late {
                csv.push_str(&format!(
                    "step-{},{:.1},0,0,0,0,{q:.3},0,0\n",
                    name(policy),
                    (*at - step_at).as_secs_f64() * 1e3
                ));
            }
        }
        let max_after = late.iter().map(|x| x.1).fold(0.0, f64::max);
        // Steady state: the p95 queueing delay of fragments arriving in the second
        // half after the step. Settled: after the last run of five consecutive
        // fragments (by arrival) in the first half whose median is above it (+10%,
        // +5 ms). A median of five, not one fragment: with Poisson arrivals one in
        // twenty lies above any p95 by definition, early or late.
        let second = step_at + Duration::from_secs_f64(half / 2.0);
        let steady: Vec<f64> = late.iter().filter(|x| x.0 >= second).map(|x| x.1).collect();
        let level = pct(steady, 0.95) * 1.1 + 5.0;
        let settle = if late.iter().any(|x| x.0 >= second) {
            Some(
                late.windows(5)
                    .filter(|w| w[4].0 < second)
                    .filter(|w| pct(w.iter().map(|x| x.1).collect(), 0.5) > level)
                    .map(|w| (w[4].0 - step_at).as_secs_f64() * 1e3)
                    .fold(0.0, f64::max),
            )
        } else {
            None
        };
        let st = Step {
            policy: name(policy).into(),
            max_queue_ms_after: max_after,
            settle_ms: settle,
            failed: before.iter().chain(&after).filter(|d| !d.ok).count(),
        };
        println!(
            "{:<9} step 0.7x→1.4x: max node queueing after the step {:.1} ms (patient requests aside), settled {}",
            st.policy,
            st.max_queue_ms_after,
            st.settle_ms
                .map(|v| format!("within {v:.0} ms"))
                .unwrap_or_else(|| "- (nothing ran at the node)".into())
        );
        steps.push(st);
        drop(s);
        n.stop().await;
    }

    // Targets, as the issue states them.
    println!();
    let worst_node_p99 = levels
        .iter()
        .filter(|l| l.policy == "adaptive")
        .filter_map(|l| l.admitted_node_p99_ms)
        .fold(0.0, f64::max);
    println!(
        "adaptive: p99 of admitted requests at the node at most {worst_node_p99:.1} ms \
         against 2 x unloaded {:.1} ms ({})",
        2.0 * unloaded_node_p99,
        if worst_node_p99 <= 2.0 * unloaded_node_p99 {
            "met"
        } else {
            "MISSED"
        }
    );
    for &load in &args.loads {
        let g = |p: &str| {
            levels
                .iter()
                .find(|l| l.policy == p && l.load == load)
                .map(|l| l.goodput_qps)
                .unwrap_or(0.0)
        };
        let (a, n, ad) = (g("always"), g("never"), g("adaptive"));
        let ratio = if a.min(n) > 0.0 {
            format!("{:.2}x the worse", ad / a.min(n))
        } else {
            "the worse completed nothing in the window".into()
        };
        println!(
            "load {load:.1}x: adaptive {ad:.2} q/s vs best {:.2} ({}), worst {:.2}: {ratio}",
            a.max(n),
            if ad >= a.max(n) { "met" } else { "MISSED" },
            a.min(n),
        );
    }

    let json = args
        .json
        .clone()
        .unwrap_or_else(|| default_json_path("admission"));
    let report = Report {
        scale: args.scale,
        capacity_qps: capacity,
        unloaded_p99_ms: unloaded_p99,
        unloaded_node_p99_ms: unloaded_node_p99,
        queue_target_ms: args.queue_target_ms,
        levels: levels.clone(),
        steps,
    };
    write_json(&json, &report).expect("json");
    if let Some(path) = &args.fragments {
        std::fs::write(path, &csv).expect("fragments csv");
        println!("wrote {}", path.display());
    }
    let svg = json.with_extension("svg");
    plot(&svg, &levels).expect("svg");
    println!("wrote {} and {}", json.display(), svg.display());
}

fn plot(path: &std::path::Path, levels: &[Level]) -> Result<(), csd_testbed::Error> {
    let series: Vec<(String, Vec<(f64, f64)>)> = ["always", "never", "adaptive"]
        .iter()
        .map(|p| {
            let pts = levels
                .iter()
                .filter(|l| l.policy == *p)
                .map(|l| (l.load, l.goodput_qps))
                .collect();
            (p.to_string(), pts)
        })
        .collect();
    csd_testbed::report::plots::line_chart(
        path,
        "Goodput against offered load (one node, --cpus 1)",
        "offered load (x node capacity)",
        "goodput (queries/s)",
        &series,
        false,
        false,
        None,
        1,
    )
}
