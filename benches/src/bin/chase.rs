//! Shipped code, measured: the X-RDMA experiment done at storage, and what a Wasm
//! guest costs against the node's native engine.
//!
//! 1. `chase`: a k-hop pointer chase over a linked structure of 16-byte records stored
//!    at a node, through a throttled link (testbed proxy) at several RTTs: hop by hop
//!    (one `Range` read per hop from the compute side) vs one pushed request running
//!    the `chase` guest at the node. Medians of `--runs`.
//! 2. `overhead`: the `filter_map` guest vs the same filter and expression as a native
//!    pushed SQL fragment over lineitem (`--scale`), rows/s at the node.
//! 3. `start`: invoking the `filter_map` guest on one small batch: cold (compile),
//!    warm (compiled, new instance), hot (instance reused); p50/p99.
//!
//! Build the guests first: `scripts/build-wasm-examples.sh`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use clap::Parser;
use csd_benches::{default_json_path, write_json};
use csd_client::demo::{chain, lineitem, put_chain};
use csd_query_pushdown::{Cluster, CsdSession, SessionOptions, WasmJob};
use csd_runtime::config::{ByteSize, NodeConfig};
use csd_runtime::memory::MemoryLedger;
use csd_runtime::node;
use csd_runtime::node_client::NodeClient;
use csd_runtime::sandbox::{Sandbox, SandboxLimits};
use csd_testbed::link::{LinkSpec, ThrottledLink};
use futures::StreamExt;
use serde::Serialize;

#[derive(Parser)]
struct Args {
    /// Where the example guests are (default: $CARGO_TARGET_DIR/wasm or target/wasm).
    #[arg(long)]
    wasm_dir: Option<PathBuf>,
    /// Repetitions per point (medians are reported).
    #[arg(long, default_value_t = 7)]
    runs: usize,
    /// Round-trip times to emulate, in ms.
    #[arg(long, value_delimiter = ',', default_value = "0.2,1,10")]
    rtt_ms: Vec<f64>,
    /// Hops to follow.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    hops: Vec<u64>,
    /// Link bandwidth, Mbit/s.
    #[arg(long, default_value_t = 1000.0)]
    mbit: f64,
    /// TPC-H scale of lineitem for the overhead part (0: skip it).
    #[arg(long, default_value_t = 0.1)]
    scale: f64,
    /// Write the JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// The chase guest: `chase` (Rust, with the SDK: 1.3 MB) or `chase_c` (C, no
    /// SDK: 9 KB, rides inside the request).
    #[arg(long, default_value = "chase")]
    chase_guest: String,
    /// Skip the start-latency and CPU-time-limit parts (for profiling the others).
    #[arg(long)]
    skip_start: bool,
    /// Run the pushed chase on a leased slot (`csd run --lease`): past admission.
    #[arg(long)]
    lease: bool,
}

#[derive(Serialize)]
struct ChasePoint {
    rtt_ms: f64,
    hops: u64,
    hop_by_hop_ms: f64,
    pushed_ms: f64,
    speedup: f64,
}

#[derive(Serialize, Default)]
struct Report {
    chase: Vec<ChasePoint>,
    overhead: Option<Overhead>,
    start: Option<Start>,
    /// The same with wasmtime's pooling allocator (16 slots).
    start_pooled: Option<Start>,
    /// Time until a spinning guest with a 500 ms CPU-time limit is stopped.
    spin_ms: Option<f64>,
}

#[derive(Serialize)]
struct Overhead {
    rows: u64,
    native_ms: f64,
    wasm_ms: f64,
    native_rows_per_s: f64,
    wasm_rows_per_s: f64,
    ratio: f64,
}

#[derive(Serialize)]
struct Start {
    cold_ms: f64,
    warm_p50_us: f64,
    warm_p99_us: f64,
    hot_p50_us: f64,
    hot_p99_us: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn pct(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

async fn session(url: &str) -> CsdSession {
    session_with(url, Default::default()).await
}

async fn session_with(url: &str, creds: csd_runtime::node_client::Credentials) -> CsdSession {
    Cluster::connect_with(&[url.to_string()], &creds)
        .await
        .expect("connect")
        .session(SessionOptions::default())
        .await
        .expect("session")
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let dir = args.wasm_dir.clone().unwrap_or_else(|| {
        PathBuf::from(std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into()))
            .join("wasm")
    });
    let guest = |n: &str| {
        std::fs::read(dir.join(format!("{n}.wasm"))).unwrap_or_else(|e| {
            panic!(
                "{}/{n}.wasm: {e} (run scripts/build-wasm-examples.sh)",
                dir.display()
            )
        })
    };
    let config = NodeConfig {
        device: "emulated:mem".into(),
        capacity: ByteSize::gib(4),
        listen: "127.0.0.1:0".into(),
        cpus: 2,
        ..NodeConfig::default()
    };
    let operators = csd_query_pushdown::registry_with(&config).expect("registry");
    let node = node::start_with(&config, operators).await.expect("node");
    let direct = NodeClient::connect(&node.url).await.expect("client");
    let n = 1u64 << 16;
    let (object, base) = put_chain(&direct, &chain(n, 42)).await.expect("chain");
    let upstream = node
        .url
        .trim_start_matches("grpc://")
        .parse()
        .expect("addr");
    // Held once as `Bytes`, as a client that runs a module repeatedly would.
    let chase = bytes::Bytes::from(guest(&args.chase_guest));
    let mut report = Report::default();
    let mut creds = csd_runtime::node_client::Credentials::default();
    if args.lease {
        let l = direct
            .lease(1, std::time::Duration::from_secs(3600))
            .await
            .expect("lease");
        creds.leases = vec![l.id];
    }
    println!(
        "pointer chase, {n} records, {} Mbit/s, median of {}{}",
        args.mbit,
        args.runs,
        if args.lease {
            ", pushed on a leased slot"
        } else {
            ""
        }
    );
    println!(
        "{:>8} {:>5} {:>14} {:>12} {:>8}",
        "RTT ms", "hops", "hop-by-hop ms", "pushed ms", "speedup"
    );
    for &rtt in &args.rtt_ms {
        let spec = LinkSpec::mbit(args.mbit, (rtt * 500.0) as u64);
        let link = ThrottledLink::start(spec, upstream).await.expect("link");
        let client = NodeClient::connect(&link.url()).await.expect("client");
        let s = session_with(&link.url(), creds.clone()).await;
        let job = |hops: u64, start: u64| WasmJob {
            module: chase.clone(),
            table: "chain".into(),
            columns: vec![],
            filter: None,
            rows: false,
            args: BTreeMap::from([
                ("object".to_string(), object.clone()),
                ("base".to_string(), base.to_string()),
                ("start".to_string(), start.to_string()),
                ("hops".to_string(), hops.to_string()),
            ]),
        };
        // Warm: the module reaches the node and compiles once.
        s.run_wasm(&job(1, 0)).await.expect("warm");
        for &hops in &args.hops {
            let (mut by_hop, mut pushed) = (Vec::new(), Vec::new());
            for r in 0..args.runs {
                let start = (r as u64 * 7919) % n;
                let t = Instant::now();
                let mut at = start;
                for _ in 0..hops {
                    let b = client
                        .read_range(&object, base + 16 * at, 16)
                        .await
                        .expect("range");
                    at = u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
                }
                by_hop.push(t.elapsed().as_secs_f64() * 1e3);
                let t = Instant::now();
                let run = s.run_wasm(&job(hops, start)).await.expect("pushed");
                pushed.push(t.elapsed().as_secs_f64() * 1e3);
                let last = run.batches[0]
                    .column(1)
                    .as_any()
                    .downcast_ref::<arrow::array::Int64Array>()
                    .expect("last")
                    .value(0);
                assert_eq!(
                    last as u64, at,
                    "the pushed chase ends where hops by range end"
                );
            }
            let (h, p) = (median(by_hop), median(pushed));
            println!("{rtt:>8} {hops:>5} {h:>14.2} {p:>12.2} {:>7.2}x", h / p);
            report.chase.push(ChasePoint {
                rtt_ms: rtt,
                hops,
                hop_by_hop_ms: h,
                pushed_ms: p,
                speedup: h / p,
            });
        }
        link.shutdown().await;
    }

    if args.scale > 0.0 {
        let parts = lineitem(args.scale, 1, 1).expect("lineitem");
        let rows: u64 = parts.iter().map(|b| b.num_rows() as u64).sum();
        direct
            .put(
                "lineitem",
                "0",
                parts[0].schema(),
                futures::stream::iter(parts.into_iter().map(Ok)).boxed(),
            )
            .await
            .expect("put");
        let s = session(&node.url).await;
        let native_sql = "SELECT l_orderkey, CAST(l_extendedprice AS DOUBLE) * (1 - CAST(l_discount AS DOUBLE)) \
             FROM lineitem WHERE l_quantity < 30 AND l_shipmode = 'AIR'";
        let job = WasmJob {
            module: guest("filter_map").into(),
            table: "lineitem".into(),
            columns: ["l_orderkey", "l_extendedprice", "l_discount", "l_shipmode"]
                .map(String::from)
                .to_vec(),
            filter: Some("l_quantity < 30".into()),
            args: BTreeMap::from([("mode".to_string(), "AIR".to_string())]),
            rows: true,
        };
        s.run_wasm(&job).await.expect("warm");
        let (mut native, mut wasm) = (Vec::new(), Vec::new());
        for _ in 0..args.runs {
            let t = Instant::now();
            let a = s.run(native_sql).await.expect("native");
            native.push(t.elapsed().as_secs_f64() * 1e3);
            let t = Instant::now();
            let b = s.run_wasm(&job).await.expect("wasm");
            wasm.push(t.elapsed().as_secs_f64() * 1e3);
            let count = |bs: &[arrow::record_batch::RecordBatch]| {
                bs.iter().map(|b| b.num_rows()).sum::<usize>()
            };
            assert_eq!(count(&a.batches), count(&b.batches));
        }
        let (nm, wm) = (median(native), median(wasm));
        let o = Overhead {
            rows,
            native_ms: nm,
            wasm_ms: wm,
            native_rows_per_s: rows as f64 / nm * 1e3,
            wasm_rows_per_s: rows as f64 / wm * 1e3,
            ratio: nm / wm,
        };
        println!(
            "\nfilter+map over lineitem SF {} ({rows} rows), median of {}:\n  native pushed SQL {:.1} ms ({:.1} M rows/s)\n  wasm filter_map   {:.1} ms ({:.1} M rows/s)\n  wasm / native throughput: {:.2}x",
            args.scale,
            args.runs,
            nm,
            o.native_rows_per_s / 1e6,
            wm,
            o.wasm_rows_per_s / 1e6,
            o.ratio
        );
        report.overhead = Some(o);
    }

    if !args.skip_start {
        report.start = Some(start_latency(&guest("filter_map"), 0).await);
        report.start_pooled = Some(start_latency(&guest("filter_map"), 16).await);
        report.spin_ms = Some(spin_time(&guest("spin")).await);
    }
    write_json(
        &args.json.unwrap_or_else(|| default_json_path("chase")),
        &report,
    )
    .expect("json");
}

/// How long after its start a guest that never returns is stopped, with a 500 ms
/// CPU-time limit.
async fn spin_time(module: &[u8]) -> f64 {
    let limits = SandboxLimits {
        cpu_time: std::time::Duration::from_millis(500),
        ..SandboxLimits::default()
    };
    let sandbox =
        Arc::new(Sandbox::new(limits, MemoryLedger::new(1 << 30), None).expect("sandbox"));
    let m = sandbox.compile(module).await.expect("compile");
    let batch =
        arrow::record_batch::RecordBatch::new_empty(Arc::new(arrow::datatypes::Schema::empty()));
    let t = Instant::now();
    let mut g = sandbox
        .instantiate(&m, &BTreeMap::new(), None, Arc::new(AtomicBool::new(false)))
        .expect("instance");
    let e = g.batch(&batch).expect_err("spin never returns");
    let ms = t.elapsed().as_secs_f64() * 1e3;
    println!(
        "
a guest that never returns, 500 ms CPU-time limit: stopped after {ms:.1} ms ({e})"
    );
    ms
}

/// Cold, warm and hot invocations of a guest on one small batch, in this process.
/// Start latency of the filter_map guest; `pool` slots in wasmtime's pooling
/// allocator (0: instances allocated on demand).
async fn start_latency(module: &[u8], pool: u32) -> Start {
    let schema = Arc::new(arrow::datatypes::Schema::new(vec![
        arrow::datatypes::Field::new("l_orderkey", arrow::datatypes::DataType::Int64, false),
        arrow::datatypes::Field::new(
            "l_extendedprice",
            arrow::datatypes::DataType::Float64,
            false,
        ),
        arrow::datatypes::Field::new("l_discount", arrow::datatypes::DataType::Float64, false),
        arrow::datatypes::Field::new("l_shipmode", arrow::datatypes::DataType::Utf8, false),
    ]));
    let batch = arrow::record_batch::RecordBatch::try_new(
        schema,
        vec![
            Arc::new(arrow::array::Int64Array::from_iter_values(0..64)),
            Arc::new(arrow::array::Float64Array::from_iter_values(
                (0..64).map(f64::from),
            )),
            Arc::new(arrow::array::Float64Array::from_iter_values(
                (0..64).map(|_| 0.05),
            )),
            Arc::new(arrow::array::StringArray::from_iter_values(
                (0..64).map(|i| if i % 2 == 0 { "AIR" } else { "RAIL" }),
            )),
        ],
    )
    .expect("batch");
    let args = BTreeMap::from([("mode".to_string(), "AIR".to_string())]);
    let sandbox = |_: ()| {
        let limits = SandboxLimits {
            pool,
            ..SandboxLimits::default()
        };
        Arc::new(Sandbox::new(limits, MemoryLedger::new(1 << 30), None).expect("sandbox"))
    };
    let t = Instant::now();
    let cold = sandbox(());
    let m = cold.compile(module).await.expect("compile");
    let cancel = Arc::new(AtomicBool::new(false));
    let mut g = cold
        .instantiate(&m, &args, None, cancel.clone())
        .expect("instance");
    g.batch(&batch).expect("batch");
    let cold_ms = t.elapsed().as_secs_f64() * 1e3;
    let (mut warm, mut hot) = (Vec::new(), Vec::new());
    for _ in 0..500 {
        let t = Instant::now();
        let mut w = cold
            .instantiate(&m, &args, None, cancel.clone())
            .expect("instance");
        w.batch(&batch).expect("batch");
        warm.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        g.batch(&batch).expect("batch");
        hot.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let s = Start {
        cold_ms,
        warm_p50_us: pct(warm.clone(), 0.5),
        warm_p99_us: pct(warm, 0.99),
        hot_p50_us: pct(hot.clone(), 0.5),
        hot_p99_us: pct(hot, 0.99),
    };
    println!(
        "\ninvoking filter_map on a 64-row batch (in process, 500 runs, pool {pool}):\n  cold (compile + instantiate + call) {:.1} ms\n  warm (instantiate + call) p50 {:.0} us, p99 {:.0} us\n  hot (call on a live instance) p50 {:.0} us, p99 {:.0} us",
        s.cold_ms, s.warm_p50_us, s.warm_p99_us, s.hot_p50_us, s.hot_p99_us
    );
    s
}
