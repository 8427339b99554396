//! Invocation latency on a leased slot, on loopback: hot (the lease's instance),
//! warm (a compiled module, a new instance), cold (the module sent and compiled),
//! against the floor of a plain `DoGet` round trip (a 16-byte range read). p50/p99.

use csd_protocol::actions::Start;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::{ArrayRef, Float64Array};
use arrow::record_batch::RecordBatch;
use clap::Parser;
use csd_benches::{default_json_path, write_json};
use csd_runtime::config::{ByteSize, NodeConfig};
use csd_runtime::node;
use csd_runtime::node_client::NodeClient;
use csd_runtime::sandbox::ModuleDigest;
use serde::Serialize;

#[derive(Parser)]
struct Args {
    /// Where the example guests are (default: $CARGO_TARGET_DIR/wasm or target/wasm).
    #[arg(long)]
    wasm_dir: Option<PathBuf>,
    /// Calls per hot/warm/floor point.
    #[arg(long, default_value_t = 500)]
    runs: usize,
    /// Cold calls (each compiles a module).
    #[arg(long, default_value_t = 3)]
    cold_runs: usize,
    /// Write the JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Serialize)]
struct Point {
    what: &'static str,
    p50_us: f64,
    p99_us: f64,
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// `module` with a custom section appended: the same code under a new digest.
fn renamed(module: &[u8], n: usize) -> Vec<u8> {
    let name = b"csd-bench";
    let payload = n.to_le_bytes();
    let size = 1 + name.len() + payload.len();
    let mut out = module.to_vec();
    out.push(0);
    out.push(size as u8);
    out.push(name.len() as u8);
    out.extend_from_slice(name);
    out.extend_from_slice(&payload);
    out
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let dir = args.wasm_dir.clone().unwrap_or_else(|| {
        PathBuf::from(std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into()))
            .join("wasm")
    });
    let module = std::fs::read(dir.join("functions.wasm")).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (build the guests: scripts/build-wasm-examples.sh)",
            dir.join("functions.wasm").display()
        )
    });
    let config = NodeConfig {
        device: "emulated:mem".into(),
        capacity: ByteSize::gib(1),
        listen: "127.0.0.1:0".into(),
        cpus: 2,
        ..NodeConfig::default()
    };
    let node = node::start_with(&config, csd_runtime::operator::OperatorRegistry::new())
        .await
        .expect("node");
    let c = NodeClient::connect(&node.url).await.expect("client");
    let store = &node.state.node.tables;
    store
        .object_store()
        .put("bench/0/00000000.bin", &[7u8; 4096])
        .await
        .expect("object");
    let batch = RecordBatch::try_from_iter([
        (
            "p",
            Arc::new(Float64Array::from(vec![100.0; 64])) as ArrayRef,
        ),
        ("d", Arc::new(Float64Array::from(vec![0.1; 64])) as ArrayRef),
    ])
    .expect("batch");
    let digest = ModuleDigest::of(&module);
    let ttl = Duration::from_secs(600);
    let time = |t: Instant| t.elapsed().as_secs_f64() * 1e6;
    let mut points = Vec::new();

    let mut floor = Vec::new();
    for _ in 0..args.runs {
        let t = Instant::now();
        c.read_range("bench/0/00000000.bin", 0, 16)
            .await
            .expect("range");
        floor.push(time(t));
    }
    let lease = c.lease(1, ttl).await.expect("lease");
    let first = c
        .invoke(&lease.id, &digest, &module, "discounted", &batch)
        .await
        .expect("first");
    assert_eq!(first.start, Start::Cold);
    let mut hot = Vec::new();
    for _ in 0..args.runs {
        let t = Instant::now();
        let r = c
            .invoke(&lease.id, &digest, &module, "discounted", &batch)
            .await
            .expect("hot");
        hot.push(time(t));
        assert_eq!(r.start, Start::Hot);
    }
    c.release_lease(&lease.id).await.expect("release");
    let mut warm = Vec::new();
    for _ in 0..args.runs.min(200) {
        let l = c.lease(1, ttl).await.expect("lease");
        let t = Instant::now();
        let r = c
            .invoke(&l.id, &digest, &module, "discounted", &batch)
            .await
            .expect("warm");
        warm.push(time(t));
        assert_eq!(r.start, Start::Warm);
        c.release_lease(&l.id).await.expect("release");
    }
    let mut cold = Vec::new();
    for n in 0..args.cold_runs {
        let m = renamed(&module, n + 1);
        let d = ModuleDigest::of(&m);
        let l = c.lease(1, ttl).await.expect("lease");
        let t = Instant::now();
        let r = c
            .invoke(&l.id, &d, &m, "discounted", &batch)
            .await
            .expect("cold");
        cold.push(time(t));
        assert_eq!(r.start, Start::Cold);
        c.release_lease(&l.id).await.expect("release");
    }
    println!(
        "invocation on a leased slot, loopback, 64-row batch of 2 doubles ({} calls; cold {}):",
        args.runs, args.cold_runs
    );
    for (what, v) in [
        ("DoGet round trip (floor)", &mut floor),
        ("hot", &mut hot),
        ("warm", &mut warm),
        ("cold", &mut cold),
    ] {
        let (p50, p99) = (pct(v, 0.5), pct(v, 0.99));
        println!("  {what:<26} p50 {p50:>9.0} us   p99 {p99:>9.0} us");
        points.push(Point {
            what: match what {
                "hot" => "hot",
                "warm" => "warm",
                "cold" => "cold",
                _ => "floor",
            },
            p50_us: p50,
            p99_us: p99,
        });
    }
    let ratio = points[1].p50_us / points[0].p50_us;
    println!("  hot p50 / floor p50: {ratio:.2}x");
    write_json(
        &args.json.unwrap_or_else(|| default_json_path("lease")),
        &points,
    )
    .expect("json");
}
