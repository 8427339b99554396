//! A three-step pipeline (filter → key filter → aggregate) over lineitem, two ways,
//! side by side over the testbed's throttled link:
//!
//! - `kept`: each step keeps its answer at the node (`CsdSession::keep`) and the next
//!   step reads it there as table `csd_ref_…`; only the last answer crosses the link.
//! - `shipped`: each step's answer comes back to the client, which sends it to the
//!   node again (`put`) as the next step's input — what a pipeline does without
//!   references.
//!
//! Prints time and bytes over the link (both directions) per bandwidth, medians; the
//! two final answers are checked equal every run.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use arrow::record_batch::RecordBatch;
use clap::Parser;
use csd_benches::pipeline_steps::{STEP1, step2, step3};
use csd_benches::{default_json_path, write_json};
use csd_client::demo::lineitem;
use csd_query_pushdown::{Cluster, CsdSession, SessionOptions};
use csd_runtime::config::{ByteSize, NodeConfig};
use csd_runtime::node;
use csd_runtime::node_client::NodeClient;
use csd_testbed::link::{LinkSpec, ThrottledLink};
use serde::Serialize;

#[derive(Parser)]
struct Args {
    /// TPC-H scale of lineitem.
    #[arg(long, default_value_t = 0.1)]
    scale: f64,
    /// Repetitions per point (medians are reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Link bandwidths, Mbit/s.
    #[arg(long, value_delimiter = ',', default_value = "100,1000")]
    mbit: Vec<f64>,
    /// Round-trip time of the link, ms.
    #[arg(long, default_value_t = 1.0)]
    rtt_ms: f64,
    /// Write the JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Serialize)]
struct Point {
    mbit: f64,
    kept_ms: f64,
    kept_bytes: u64,
    shipped_ms: f64,
    shipped_bytes: u64,
    speedup: f64,
    bytes_ratio: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn session(url: &str) -> CsdSession {
    Cluster::connect(&[url.to_string()])
        .await
        .expect("connect")
        .session(SessionOptions::default())
        .await
        .expect("session")
}

fn rows_of(b: &[RecordBatch]) -> Vec<String> {
    let mut out = Vec::new();
    for b in b {
        let cols: Vec<_> = b
            .columns()
            .iter()
            .map(|c| {
                arrow::util::display::ArrayFormatter::try_new(c.as_ref(), &Default::default())
                    .expect("format")
            })
            .collect();
        for i in 0..b.num_rows() {
            out.push(
                cols.iter()
                    .map(|c| c.value(i).to_string())
                    .collect::<Vec<_>>()
                    .join("|"),
            );
        }
    }
    out
}

/// The pipeline with each step kept at the node: the final answer, and the
/// references to release afterwards (not part of the pipeline's time).
async fn kept(url: &str) -> (Vec<RecordBatch>, Vec<csd_runtime::refs::Reference>) {
    let ttl = Duration::from_secs(600);
    let t = Instant::now();
    let lap = |what: &str| {
        if std::env::var_os("PIPELINE_LAPS").is_some() {
            eprintln!("  {what}: {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
        }
    };
    let s1 = session(url).await;
    lap("session 1");
    let k1 = s1.keep(STEP1, ttl).await.expect("keep step 1");
    lap("keep 1");
    let t1 = k1[0].reference.table.clone();
    let s2 = session(url).await;
    lap("session 2");
    let k2 = s2.keep(&step2(&t1), ttl).await.expect("keep step 2");
    lap("keep 2");
    let t2 = k2[0].reference.table.clone();
    let s3 = session(url).await;
    lap("session 3");
    let out = s3.run(&step3(&t2)).await.expect("step 3").batches;
    lap("step 3");
    let refs = k1.iter().chain(&k2).map(|k| k.reference.clone()).collect();
    (out, refs)
}

/// Runs `sql`, brings its answer here and sends it back as table `name`.
async fn run_and_put(url: &str, c: &NodeClient, sql: &str, name: &str) {
    let got = session(url).await.run(sql).await.expect("step").batches;
    let schema = got.first().map(|b| b.schema()).expect("rows");
    c.put(
        name,
        "0",
        schema,
        futures::stream::iter(got.into_iter().map(Ok)),
    )
    .await
    .expect("put");
}

/// The pipeline with each step's answer shipped back and sent again: the final
/// answer, and the tables to delete afterwards (not part of the pipeline's time).
async fn shipped(url: &str, run: usize) -> (Vec<RecordBatch>, Vec<String>) {
    let c = NodeClient::connect(url).await.expect("client");
    let (t1, t2) = (format!("pipeline_a_{run}"), format!("pipeline_b_{run}"));
    run_and_put(url, &c, STEP1, &t1).await;
    run_and_put(url, &c, &step2(&t1), &t2).await;
    let out = session(url)
        .await
        .run(&step3(&t2))
        .await
        .expect("step 3")
        .batches;
    (out, vec![t1, t2])
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let config = NodeConfig {
        device: "emulated:mem".into(),
        capacity: ByteSize::gib(8),
        listen: "127.0.0.1:0".into(),
        cpus: 2,
        ..NodeConfig::default()
    };
    let operators = csd_query_pushdown::registry_with(&config).expect("registry");
    let node = node::start_with(&config, operators).await.expect("node");
    let direct = NodeClient::connect(&node.url).await.expect("client");
    for (i, b) in lineitem(args.scale, 2, 1)
        .expect("lineitem")
        .into_iter()
        .enumerate()
    {
        direct
            .put(
                "lineitem",
                &i.to_string(),
                b.schema(),
                futures::stream::iter([Ok(b)]),
            )
            .await
            .expect("put");
    }
    let upstream = node
        .url
        .trim_start_matches("grpc://")
        .parse()
        .expect("addr");
    println!(
        "pipeline filter -> key filter -> aggregate over lineitem SF {}, RTT {} ms, median of {}",
        args.scale, args.rtt_ms, args.runs
    );
    println!(
        "{:>8} {:>10} {:>12} {:>12} {:>14} {:>8} {:>8}",
        "Mbit/s", "kept ms", "kept bytes", "shipped ms", "shipped bytes", "speedup", "bytes"
    );
    let mut points = Vec::new();
    for &mbit in &args.mbit {
        let link =
            ThrottledLink::start(LinkSpec::mbit(mbit, (args.rtt_ms * 500.0) as u64), upstream)
                .await
                .expect("link");
        let url = link.url();
        let moved = || link.counters().up() + link.counters().down();
        let (mut k_ms, mut k_b, mut s_ms, mut s_b) = (vec![], vec![], vec![], vec![]);
        for run in 0..args.runs {
            let (b0, t) = (moved(), Instant::now());
            let (a, refs) = kept(&url).await;
            k_ms.push(t.elapsed().as_secs_f64() * 1e3);
            k_b.push((moved() - b0) as f64);
            let (b0, t) = (moved(), Instant::now());
            let (b, tables) = shipped(&url, run).await;
            s_ms.push(t.elapsed().as_secs_f64() * 1e3);
            s_b.push((moved() - b0) as f64);
            assert_eq!(rows_of(&a), rows_of(&b), "the two pipelines disagree");
            for r in &refs {
                direct.release(r).await.expect("release");
            }
            for t in &tables {
                direct.delete(t, None).await.expect("delete");
            }
        }
        let p = Point {
            mbit,
            kept_ms: median(k_ms),
            kept_bytes: median(k_b) as u64,
            shipped_ms: median(s_ms),
            shipped_bytes: median(s_b) as u64,
            speedup: 0.0,
            bytes_ratio: 0.0,
        };
        let p = Point {
            speedup: p.shipped_ms / p.kept_ms,
            bytes_ratio: p.shipped_bytes as f64 / p.kept_bytes.max(1) as f64,
            ..p
        };
        println!(
            "{:>8} {:>10.1} {:>12} {:>12.1} {:>14} {:>7.2}x {:>7.0}x",
            mbit, p.kept_ms, p.kept_bytes, p.shipped_ms, p.shipped_bytes, p.speedup, p.bytes_ratio
        );
        points.push(p);
        link.shutdown().await;
    }
    let path = args.json.unwrap_or_else(|| default_json_path("pipeline"));
    write_json(&path, &points).expect("json");
}
