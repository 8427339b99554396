//! Small variants of the shipped scenarios, run end to end: real nodes, real links,
//! real queries; answers compared with the baseline, reports written.

use std::path::Path;

use csd_testbed::report::Report;
use csd_testbed::scenario::{PolicyName, Scenario};
use csd_testbed::{RunOptions, run};

async fn run_text(text: &str, dir: &Path) -> Report {
    let s = Scenario::parse(text).expect("valid scenario");
    run(
        s,
        &RunOptions {
            out: dir.to_path_buf(),
            quick: false,
            progress: false,
        },
    )
    .await
    .expect("scenario runs")
}

fn assert_clean(r: &Report) {
    for run in &r.runs {
        assert!(
            run.mismatches.is_empty(),
            "{} at {:?}: {:?}",
            run.policy,
            run.point,
            run.mismatches
        );
        assert_eq!(
            run.failed, 0,
            "{} at {:?}: {:?}",
            run.policy, run.point, run.errors
        );
        assert!(
            !run.timed_out,
            "{} at {:?} timed out",
            run.policy, run.point
        );
        assert!(run.completed > 0);
    }
}

fn assert_report_files(dir: &Path, extra: &[&str]) {
    for f in ["report.md", "report.json", "bytes.svg", "p99.svg"]
        .iter()
        .chain(extra)
    {
        let p = dir.join(f);
        let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        if f.ends_with(".svg") {
            assert!(
                text.contains("<svg") && text.contains("polyline"),
                "{f} has no curve"
            );
        }
    }
    let md = std::fs::read_to_string(dir.join("report.md")).expect("md");
    assert!(
        md.contains("## Headline") && md.contains("bytes from the nodes"),
        "{md}"
    );
    let back: Report =
        serde_json::from_slice(&std::fs::read(dir.join("report.json")).expect("json"))
            .expect("parses");
    assert!(!back.runs.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_pushdown_vs_none_across_bandwidth() {
    let dir = tempfile::tempdir().expect("tempdir");
    let r = run_text(
        r#"
name = "bw-small"
policies = ["none", "full", "adaptive"]
timeout_s = 120
[nodes]
count = 1
cpus = 2
memory = "512MiB"
capacity = "256MiB"
[link]
latency_us = 200
[data]
kind = "tpch"
scale = 0.01
[workload]
kind = "sql"
queries = [6, "SELECT l_orderkey, l_extendedprice FROM lineitem WHERE l_quantity <= 50 * {selectivity}"]
selectivity = 0.1
[[sweep]]
parameter = "link.bandwidth_mbit"
values = [50, 0]
"#,
        dir.path(),
    )
    .await;
    assert_clean(&r);
    assert_eq!(r.runs.len(), 6);
    for pt in [50.0, 0.0] {
        let at = |p: PolicyName| {
            r.runs
                .iter()
                .find(|x| x.policy == p && x.point[0].1 == pt)
                .expect("run")
        };
        let (none, full) = (at(PolicyName::None), at(PolicyName::Full));
        assert_eq!(none.completed, 2);
        // Q6 is an aggregate and the scan keeps 10% of two columns: far fewer bytes.
        assert!(
            full.bytes_from_nodes * 3 < none.bytes_from_nodes,
            "full {} B vs none {} B",
            full.bytes_from_nodes,
            none.bytes_from_nodes
        );
        assert_eq!(none.fragments, 0, "no pushdown, no node requests");
        assert!(
            full.fragments > 0 && full.pushed_back == 0,
            "full never pushes back"
        );
        if pt > 0.0 {
            // The link enforces its bandwidth: nothing crosses faster.
            let floor = none.bytes_from_nodes as f64 * 8.0 / (pt * 1e6);
            assert!(
                none.wall_s >= floor * 0.95,
                "{} B in {} s is faster than {pt} Mbit/s",
                none.bytes_from_nodes,
                none.wall_s
            );
        }
    }
    assert_eq!(r.headline.len(), 2);
    assert_report_files(dir.path(), &["time.svg", "latency-0.svg", "cpu-1.svg"]);
}

/// `code.toml`, small: Wasm SQL functions at the node against the same module run
/// here over pulled columns; the same answers, far fewer bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shipped_functions_vs_pulling_the_data() {
    let dir = tempfile::tempdir().expect("tempdir");
    let r = run_text(
        r#"
name = "code-small"
policies = ["none", "full"]
timeout_s = 120
[nodes]
count = 1
cpus = 2
memory = "512MiB"
capacity = "256MiB"
[link]
latency_us = 200
bandwidth_mbit = 200
[data]
kind = "tpch"
scale = 0.01
[workload]
kind = "sql"
queries = ["SELECT l_returnflag, COUNT(*), SUM(discounted(l_extendedprice, l_discount)) FROM lineitem WHERE word_count(l_comment) > 4 GROUP BY l_returnflag ORDER BY l_returnflag"]
wasm_functions = [
  { name = "discounted", module = "$CSD_WASM/functions.wasm" },
  { name = "word_count", module = "$CSD_WASM/functions.wasm", export = "word_count" },
]
"#,
        dir.path(),
    )
    .await;
    assert_clean(&r);
    let at = |p: PolicyName| r.runs.iter().find(|x| x.policy == p).expect("run");
    let (none, full) = (at(PolicyName::None), at(PolicyName::Full));
    assert!(full.fragments > 0 && full.pushed_back == 0);
    assert!(
        full.bytes_from_nodes * 20 < none.bytes_from_nodes,
        "full {} B vs none {} B",
        full.bytes_from_nodes,
        none.bytes_from_nodes
    );
}

/// A pipeline whose steps are kept at the node moves far fewer bytes than one whose
/// steps come back and are sent again, with the same final answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelines_with_and_without_references() {
    let dir = tempfile::tempdir().expect("tempdir");
    let r = run_text(
        r#"
name = "pipeline-small"
policies = ["shipped", "kept"]
timeout_s = 120
[nodes]
count = 1
cpus = 2
memory = "512MiB"
capacity = "512MiB"
[link]
latency_us = 200
bandwidth_mbit = 200
[data]
kind = "tpch"
scale = 0.01
[workload]
kind = "pipeline"
repetitions = 2
steps = [
  "SELECT l_orderkey, l_partkey, l_quantity, l_extendedprice, l_shipmode FROM lineitem WHERE l_shipdate >= DATE '1995-06-01'",
  "SELECT l_orderkey, l_quantity, l_extendedprice, l_shipmode FROM {input} WHERE l_partkey % 10 < 3",
  "SELECT l_shipmode, count(*) AS n, sum(l_quantity) AS q, sum(l_extendedprice) AS p FROM {input} GROUP BY l_shipmode ORDER BY l_shipmode",
]
"#,
        dir.path(),
    )
    .await;
    assert_clean(&r);
    let at = |p: PolicyName| r.runs.iter().find(|x| x.policy == p).expect("run");
    let (shipped, kept) = (at(PolicyName::Shipped), at(PolicyName::Kept));
    assert_eq!((shipped.completed, kept.completed), (2, 2));
    let moved = |x: &csd_testbed::report::RunResult| x.bytes_from_nodes + x.bytes_to_nodes;
    assert!(
        moved(kept) * 5 < moved(shipped),
        "kept {} B vs shipped {} B",
        moved(kept),
        moved(shipped)
    );
    assert_report_files(dir.path(), &[]);
    // Pipeline policies belong to pipelines, and every later step reads {input}.
    let bad = Scenario::parse(
        r#"
name = "x"
policies = ["kept", "full"]
[nodes]
count = 1
[data]
kind = "tpch"
scale = 0.01
[workload]
kind = "pipeline"
steps = ["SELECT 1", "SELECT * FROM lineitem"]
"#,
    )
    .unwrap_err()
    .to_string();
    assert!(
        bad.contains("workload.steps") || bad.contains("policies"),
        "{bad}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_answers_on_one_and_three_nodes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let r = run_text(
        r#"
name = "scale-small"
policies = ["none", "adaptive"]
[nodes]
count = 1
capacity = "256MiB"
memory = "512MiB"
[link]
bandwidth_mbit = 0
latency_us = 0
[data]
kind = "tpch"
scale = 0.01
partitions = 3
[workload]
kind = "sql"
queries = [1, 12, 14]
clients = 2
[[sweep]]
parameter = "nodes.count"
values = [1, 3]
"#,
        dir.path(),
    )
    .await;
    assert_clean(&r);
    for run in &r.runs {
        // Two clients, each the mix once.
        assert_eq!(run.completed, 6, "{:?}", run.point);
    }
    // Pushdown at three nodes asks each partition's node: 3 partitions per scan.
    let three = r
        .runs
        .iter()
        .find(|x| x.policy == PolicyName::Adaptive && x.point[0].1 == 3.0)
        .expect("run");
    assert!(three.fragments >= 3 * 6, "{} fragments", three.fragments);
    assert_eq!(three.cpu.first().map(|s| s.busy.len()), Some(3));
}

/// `compute.workers`: the pushdown policy's stages on 2 in-process workers answer as
/// the session alone does, and as no pushdown does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_answers_on_the_session_and_on_workers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let r = run_text(
        r#"
name = "workers-small"
policies = ["none", "full"]
[nodes]
count = 2
capacity = "256MiB"
memory = "512MiB"
[link]
bandwidth_mbit = 0
latency_us = 0
[data]
kind = "tpch"
scale = 0.01
partitions = 4
[workload]
kind = "sql"
queries = [3, 5, 9, 13, 18, 21]
clients = 1
[[sweep]]
parameter = "compute.workers"
values = [0, 2]
"#,
        dir.path(),
    )
    .await;
    assert_clean(&r);
    let bytes = |w: f64| {
        r.runs
            .iter()
            .find(|x| x.policy == PolicyName::Full && x.point[0].1 == w)
            .expect("run")
            .bytes_from_nodes
    };
    let (here, on_workers) = (bytes(0.0), bytes(2.0));
    println!("bytes from the nodes: {here} in the session, {on_workers} on 2 workers");
    assert!(here > 0 && on_workers > 0);
    for run in &r.runs {
        assert_eq!(run.completed, 6, "{:?}", run.point);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_load_with_and_without_admission() {
    let dir = tempfile::tempdir().expect("tempdir");
    let r = run_text(
        r#"
name = "overload-small"
policies = ["full", "adaptive"]
timeout_s = 60
[nodes]
count = 1
cpus = 1
capacity = "256MiB"
memory = "512MiB"
queue_target_ms = 20
[link]
bandwidth_mbit = 0
latency_us = 0
[data]
kind = "tpch"
scale = 0.01
[workload]
kind = "sql"
queries = [6, 14]
duration_s = 1.5
[[sweep]]
parameter = "workload.load"
values = [3]
"#,
        dir.path(),
    )
    .await;
    assert_clean(&r);
    let cap = r.capacity_qps.expect("capacity measured");
    assert!(cap > 0.0);
    for run in &r.runs {
        let offered = run.offered_qps.expect("open loop");
        assert!((offered - 3.0 * cap).abs() < 1e-6 * offered.max(1.0));
    }
    let full = r
        .runs
        .iter()
        .find(|x| x.policy == PolicyName::Full)
        .expect("full");
    assert_eq!(full.pushed_back, 0, "the always-policy never pushes back");
    assert_report_files(dir.path(), &["goodput.svg", "cpu.svg"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn features_compute_only_vs_pushdown() {
    let home = csd_ml_pushdown::assets_dir();
    if !home.join("efficientnet-lite0.safetensors").is_file()
        || !home.join("textures/test").is_dir()
    {
        eprintln!(
            "skipped: ML assets missing under {} (run scripts/setup-ml.sh)",
            home.display()
        );
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    // Pinned where the machine allows (the node on one core, the compute tier's ML
    // work on the rest): features must not depend on where they are computed.
    let pin = csd_runtime::pool::available_cores().len() >= 2;
    let text = format!(
        r#"
name = "hapi-small"
policies = ["compute-only", "full", "split:5"]
timeout_s = 300
[nodes]
count = 1
cpus = 1
capacity = "256MiB"
pin = {pin}
[link]
bandwidth_mbit = 100
latency_us = 100
[data]
kind = "images"
dir = "{}"
partitions = 2
[workload]
kind = "features"
batch = 16
"#,
        home.join("textures/test").display()
    );
    let r = run_text(&text, dir.path()).await;
    assert_clean(&r);
    let md = std::fs::read_to_string(dir.path().join("report.md")).expect("report.md");
    assert_eq!(md.contains("Pinned (`nodes.pin`)"), pin, "{md}");
    // One job per policy is not a distribution: the report says so instead of
    // drawing a lone dot.
    assert!(
        md.contains("Not drawn: fewer than 2 completed queries per policy"),
        "{md}"
    );
    assert!(!dir.path().join("latency.svg").exists());
    let at = |p: PolicyName| r.runs.iter().find(|x| x.policy == p).expect("run");
    let (raw, full, five) = (
        at(PolicyName::ComputeOnly),
        at(PolicyName::Full),
        at(PolicyName::Split(5)),
    );
    assert_eq!(raw.extra["split"], 0.0);
    assert_eq!(full.extra["split"], 19.0);
    assert_eq!(five.extra["split"], 5.0);
    // Only a planned (auto) split records its plan.
    assert!(!five.extra.contains_key("plan_s") && !full.extra.contains_key("predicted_epoch_s"));
    // The same features whatever runs where: bit-identical in f32 on csd's kernels,
    // within float tolerance on onnxruntime (where it loads), which fuses the
    // operators of each part differently.
    for (what, r) in [("full", full), ("split 5", five)] {
        let err = r.extra["max_rel_err_vs_baseline"];
        assert!(
            err < 1e-5,
            "{what}: relative error {err} against compute-only"
        );
    }
    // 1,280 floats per sample against 96×96 PNGs, and block4's 40×28×28 maps.
    assert!(full.bytes_from_nodes < raw.bytes_from_nodes);
    assert!(five.bytes_from_nodes > raw.bytes_from_nodes);
}

#[test]
fn shipped_scenarios_are_valid() {
    let dir = manifest_dir().join("scenarios");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).expect("scenarios folder") {
        let p = e.expect("entry").path();
        if p.extension().is_some_and(|x| x == "toml") {
            let mut s = Scenario::from_file(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            s.shrink();
            s.validate()
                .unwrap_or_else(|e| panic!("{} shrunk: {e}", p.display()));
            n += 1;
        }
    }
    assert!(n >= 7, "expected the seven shipped scenarios, found {n}");
}

/// This crate's directory, read at run time: a test binary cached in a shared target
/// directory may have been built from a checkout at another path, and cargo does not
/// rebuild it for this one (`env!` would name the other checkout).
fn manifest_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// `nodes.secure`: every node behind TLS with tenants, every client with a token;
/// the same answers, pushdown still reducing the bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secure_nodes_answer_the_same() {
    let dir = tempfile::tempdir().expect("tempdir");
    let r = run_text(
        r#"
name = "secure-small"
policies = ["none", "full"]
timeout_s = 120
[nodes]
count = 2
cpus = 1
memory = "512MiB"
capacity = "256MiB"
secure = true
[data]
kind = "tpch"
scale = 0.01
[workload]
kind = "sql"
queries = [1, 6, 14]
"#,
        dir.path(),
    )
    .await;
    assert_clean(&r);
    let none = r
        .runs
        .iter()
        .find(|x| x.policy == PolicyName::None)
        .expect("none");
    let full = r
        .runs
        .iter()
        .find(|x| x.policy == PolicyName::Full)
        .expect("full");
    assert_eq!((none.completed, full.completed), (3, 3));
    assert!(full.fragments > 0);
    assert!(full.bytes_from_nodes * 3 < none.bytes_from_nodes);
}
