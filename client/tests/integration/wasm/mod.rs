//! Shipped code: the example guests (built by scripts/build-wasm-examples.sh) run at
//! real nodes; every answer is compared with the same computation in SQL or in Rust
//! here; hostile modules get their statuses and the node goes on serving.

use std::collections::BTreeMap;
use std::path::PathBuf;

use arrow::array::AsArray;
use arrow::datatypes::{DataType, Float64Type, Int64Type};
use arrow::record_batch::RecordBatch;
use csd_client::demo::{chain, lineitem, put_chain};
use csd_query_pushdown::{Cluster, CsdSession, SessionOptions, WasmJob, WasmRun};
use csd_runtime::admission::Policy;
use csd_runtime::config::{ByteSize, NodeConfig};
use csd_runtime::node::{self, RunningNode};
use csd_runtime::node_client::NodeClient;
use csd_runtime::{Error, StatusCode};

/// Where an example guest is built (scripts/build-wasm-examples.sh).
pub fn guest_path(name: &str) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("wasm").join(format!("{name}.wasm"))
}

/// A guest that needs a tool from the network to build (Zig for the C guest).
fn guest_if_built(name: &str) -> Option<Vec<u8>> {
    let b = std::fs::read(guest_path(name)).ok();
    if b.is_none() {
        eprintln!("skipping the {name} guest: scripts/build-wasm-examples.sh could not build it");
    }
    b
}

/// An example guest's bytes (built before the tests by scripts/test.sh).
pub fn guest(name: &str) -> Vec<u8> {
    let path = guest_path(name);
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; build the example guests first: scripts/build-wasm-examples.sh",
            path.display()
        )
    })
}

fn config(device: &str) -> NodeConfig {
    NodeConfig {
        device: device.into(),
        capacity: ByteSize::mib(512),
        listen: "127.0.0.1:0".into(),
        cpus: 2,
        wasm_cpu_ms: 1000,
        wasm_memory: ByteSize::mib(64),
        ..NodeConfig::default()
    }
}

async fn start(config: &NodeConfig) -> RunningNode {
    let operators = csd_query_pushdown::registry_with(config).unwrap();
    node::start_with(config, operators).await.unwrap()
}

/// lineitem (SF 0.01) in two partitions.
async fn load_lineitem(url: &str) {
    let c = NodeClient::connect(url).await.unwrap();
    for i in 0..2 {
        let part = lineitem(0.01, i + 1, 2).unwrap();
        let schema = part[0].schema();
        c.put(
            "lineitem",
            &format!("p{i}"),
            schema,
            futures::stream::iter(part.into_iter().map(Ok)).boxed(),
        )
        .await
        .unwrap();
    }
}

use futures::StreamExt;

async fn session(url: &str) -> CsdSession {
    Cluster::connect(&[url.to_string()])
        .await
        .unwrap()
        .session(SessionOptions::default())
        .await
        .unwrap()
}

pub(crate) fn job(
    module: &str,
    columns: &[&str],
    filter: Option<&str>,
    args: &[(&str, &str)],
) -> WasmJob {
    WasmJob {
        module: guest(module).into(),
        table: "lineitem".into(),
        columns: columns.iter().map(|c| c.to_string()).collect(),
        filter: filter.map(Into::into),
        args: args
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        rows: true,
    }
}

/// Rows of (int, double) batches, sorted, doubles rounded to 1e-6 relative.
pub(crate) fn pairs(batches: &[RecordBatch]) -> Vec<(i64, i64)> {
    let mut v = Vec::new();
    for b in batches {
        let k = b.column(0).as_primitive::<Int64Type>();
        let x = b.column(1).as_primitive::<Float64Type>();
        for i in 0..b.num_rows() {
            v.push((k.value(i), (x.value(i) * 1e4).round() as i64));
        }
    }
    v.sort_unstable();
    v
}

async fn sql(s: &CsdSession, q: &str) -> Vec<RecordBatch> {
    s.run(q).await.unwrap().batches
}

fn code_of(e: &datafusion::error::DataFusionError) -> Option<StatusCode> {
    csd_query_pushdown::error::status_code(e).into()
}

const FILTER_MAP_COLUMNS: &[&str] = &["l_orderkey", "l_extendedprice", "l_discount", "l_shipmode"];
const FILTER_MAP_SQL: &str = "SELECT l_orderkey, CAST(l_extendedprice AS DOUBLE) * (1 - CAST(l_discount AS DOUBLE)) \
     FROM lineitem WHERE l_quantity < 30 AND l_shipmode = 'AIR'";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_guests_equal_the_same_computation_in_sql_and_compile_once() {
    let node = start(&config("emulated:mem")).await;
    load_lineitem(&node.url).await;
    let s = session(&node.url).await;
    let c = NodeClient::connect(&node.url).await.unwrap();

    // A filter + map: the module's rows equal SQL's.
    let j = job(
        "filter_map",
        FILTER_MAP_COLUMNS,
        Some("l_quantity < 30"),
        &[("mode", "AIR")],
    );
    let run: WasmRun = s.run_wasm(&j).await.unwrap();
    let want = pairs(&sql(&s, FILTER_MAP_SQL).await);
    assert!(!want.is_empty());
    assert_eq!(pairs(&run.batches), want);
    assert_eq!(run.endpoints.len(), 2);
    assert!(run.endpoints.iter().all(|e| e.pushed_back.is_none()));
    // 2 MB: too large to ride in the request; sent once, by put_module.
    assert!(
        run.endpoints.iter().any(|e| e.module_sent),
        "{:?}",
        run.endpoints
    );
    let st = c.stats().await.unwrap().sandbox;
    assert_eq!(st.compiled, 1, "{st:?}");

    // The second request does not compile.
    let again = s.run_wasm(&j).await.unwrap();
    assert_eq!(pairs(&again.batches), want);
    assert!(again.endpoints.iter().all(|e| !e.module_sent));
    let st = c.stats().await.unwrap().sandbox;
    assert_eq!(st.compiled, 1, "{st:?}");
    assert!(st.cache_hits >= 2, "{st:?}");
    assert_eq!(st.memory_held, 0, "{st:?}");

    // A partial aggregate, merged here by the module: equals SQL's GROUP BY.
    let agg = s
        .run_wasm(&job(
            "partial_agg",
            &["l_returnflag", "l_extendedprice", "l_discount"],
            None,
            &[],
        ))
        .await
        .unwrap();
    assert_eq!(agg.kind, csd_runtime::sandbox::GuestKind::Aggregate);
    let want = sql(
        &s,
        "SELECT l_returnflag, SUM(CAST(l_extendedprice AS DOUBLE) * (1 - CAST(l_discount AS DOUBLE))), \
         COUNT(*) FROM lineitem GROUP BY l_returnflag ORDER BY l_returnflag",
    )
    .await;
    let groups = |bs: &[RecordBatch]| {
        let mut v = Vec::new();
        for b in bs {
            let f = arrow::compute::cast(b.column(0), &DataType::Utf8).unwrap();
            let f = f.as_string::<i32>();
            let r = b.column(1).as_primitive::<Float64Type>();
            let n = b.column(2).as_primitive::<Int64Type>();
            for i in 0..b.num_rows() {
                v.push((
                    f.value(i).to_string(),
                    (r.value(i)).round() as i64,
                    n.value(i),
                ));
            }
        }
        v.sort();
        v
    };
    let got = groups(&agg.batches);
    assert_eq!(got.len(), 3, "{got:?}");
    assert_eq!(got, groups(&want));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handed_back_code_runs_here_with_the_same_answer() {
    let mut cfg = config("emulated:mem");
    cfg.policy = Policy::Never;
    let node = start(&cfg).await;
    load_lineitem(&node.url).await;
    let s = session(&node.url).await;
    let run = s
        .run_wasm(&job(
            "filter_map",
            FILTER_MAP_COLUMNS,
            Some("l_quantity < 30"),
            &[("mode", "AIR")],
        ))
        .await
        .unwrap();
    assert!(run.endpoints.iter().all(|e| e.pushed_back.is_some()));
    assert_eq!(pairs(&run.batches), pairs(&sql(&s, FILTER_MAP_SQL).await));
}

/// The Rust chase guest from record 7, `hops` hops: it reads the chain's object
/// and needs no rows.
fn chase_job(object: &str, base: u64, hops: u64) -> WasmJob {
    WasmJob {
        module: guest("chase").into(),
        table: "chain".into(),
        columns: vec![],
        filter: None,
        rows: false,
        args: BTreeMap::from([
            ("object".to_string(), object.to_string()),
            ("base".to_string(), base.to_string()),
            ("start".to_string(), "7".to_string()),
            ("hops".to_string(), hops.to_string()),
        ]),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pointer_chase_at_the_node_equals_hop_by_hop_reads() {
    let node = start(&config("emulated:mem")).await;
    let c = NodeClient::connect(&node.url).await.unwrap();
    let n = 4096u64;
    let data = chain(n, 42);
    let (object, base) = put_chain(&c, &data).await.unwrap();
    let s = session(&node.url).await;
    // The C guest (no SDK; small enough to ride inside the request) answers alike.
    let c_guest = guest_if_built("chase_c");
    for hops in [1u64, 16, 64] {
        // Here, hop by hop, by range reads.
        let (mut at, mut sum) = (7u64, 0u64);
        for _ in 0..hops {
            let r = c.read_range(&object, base + 16 * at, 16).await.unwrap();
            sum = sum.wrapping_add(u64::from_le_bytes(r[8..16].try_into().unwrap()));
            at = u64::from_le_bytes(r[..8].try_into().unwrap());
        }
        let run = s.run_wasm(&chase_job(&object, base, hops)).await.unwrap();
        let b = &run.batches[0];
        let col = |i: usize| b.column(i).as_primitive::<Int64Type>().value(0);
        assert_eq!(
            (col(0), col(1), col(2)),
            (hops as i64, at as i64, sum as i64)
        );
        if let Some(module) = &c_guest {
            let c_run = s
                .run_wasm(&WasmJob {
                    module: module.clone().into(),
                    ..chase_job(&object, base, hops)
                })
                .await
                .unwrap();
            assert!(c_run.endpoints.iter().all(|e| !e.module_sent));
            assert_eq!(c_run.batches, run.batches, "C and Rust guests, {hops} hops");
        }
    }
    // A host read of an object that is not the tenant's, or not there, fails clearly.
    let e = s
        .run_wasm(&WasmJob {
            module: guest("chase").into(),
            table: "chain".into(),
            columns: vec!["id".into()],
            filter: None,
            args: BTreeMap::from([("object".to_string(), ".csd/ticket-key".to_string())]),
            rows: true,
        })
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Some(StatusCode::PermissionDenied), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_modules_get_their_status_and_the_node_goes_on() {
    let node = start(&config("emulated:mem")).await;
    load_lineitem(&node.url).await;
    let s = session(&node.url).await;
    let c = NodeClient::connect(&node.url).await.unwrap();
    let baseline = pairs(&sql(&s, FILTER_MAP_SQL).await);
    let cases: [(&str, StatusCode, &str); 5] = [
        ("spin", StatusCode::DeadlineExceeded, "CPU-time limit"),
        ("hog", StatusCode::ResourceExhausted, "MiB of memory"),
        ("deep", StatusCode::InvalidArgument, "call stack exhausted"),
        ("trap", StatusCode::InvalidArgument, "unreachable"),
        ("badptr", StatusCode::InvalidArgument, "outside its"),
    ];
    // Each over rows (the guest runs beside the scan) and without (it runs on the
    // request's own thread): the same status either way.
    let runs = cases.into_iter().flat_map(|(name, code, says)| {
        let over_rows = job(name, &["l_orderkey"], Some("l_orderkey < 100"), &[]);
        let no_rows = WasmJob {
            columns: vec![],
            filter: None,
            rows: false,
            ..over_rows.clone()
        };
        [(name, code, says, over_rows), (name, code, says, no_rows)]
    });
    for (name, code, says, j) in runs {
        let e = s.run_wasm(&j).await.unwrap_err();
        assert_eq!(code_of(&e), Some(code), "{name}: {e}");
        assert!(e.to_string().contains(says), "{name}: {e}");
        assert!(e.to_string().contains("wasm module sha256:"), "{name}: {e}");
        // The node still answers a normal query right, and its memory comes back (the
        // other partition's instance stops within a tick once its answer is dropped).
        assert_eq!(
            pairs(&sql(&s, FILTER_MAP_SQL).await),
            baseline,
            "after {name}"
        );
        let mut st = c.stats().await.unwrap().sandbox;
        for _ in 0..100 {
            if st.memory_held == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            st = c.stats().await.unwrap().sandbox;
        }
        assert_eq!(st.memory_held, 0, "after {name}: {st:?}");
    }
    // Not WebAssembly, or not a module.
    for bytes in [
        b"hello, not wasm".to_vec(),
        b"\0asm\x01\0\0\0\xff\xff".to_vec(),
    ] {
        let e = c.put_module(&bytes).await.unwrap_err();
        assert_eq!(e.code(), Some(tonic::Code::InvalidArgument), "{e}");
    }
    // Larger than the node takes (32 MiB by default) / than a message carries.
    let mut big = guest("trap");
    big.resize(40 << 20, 0);
    let e = c.put_module(&big).await.unwrap_err();
    assert_eq!(e.code(), Some(tonic::Code::ResourceExhausted), "{e}");
    assert!(e.to_string().contains("at most"), "{e}");
    let mut huge = job("trap", &["l_orderkey"], None, &[]);
    let mut bytes = huge.module.to_vec();
    bytes.resize(100 << 20, 0);
    huge.module = bytes.into();
    let e = s.run_wasm(&huge).await.unwrap_err();
    assert_eq!(code_of(&e), Some(StatusCode::ResourceExhausted), "{e}");
    assert_eq!(pairs(&sql(&s, FILTER_MAP_SQL).await), baseline);
}

/// A guest that runs on the request's own thread (no input rows) stops once its
/// asker goes away, long before its CPU-time limit, and the node goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_stops_when_its_asker_goes_away() {
    let node = start(&NodeConfig {
        wasm_cpu_ms: 60_000,
        ..config("emulated:mem")
    })
    .await;
    load_lineitem(&node.url).await;
    let s = session(&node.url).await;
    let spin = WasmJob {
        columns: vec![],
        filter: None,
        rows: false,
        ..job("spin", &[], None, &[])
    };
    let asker = tokio::spawn(async move { s.run_wasm(&spin).await.map(|_| ()) });
    // Running: its instance holds memory.
    let mut st = sandbox_stats(&node.url).await;
    while st.memory_held == 0 && !asker.is_finished() {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        st = sandbox_stats(&node.url).await;
    }
    assert!(st.memory_held > 0, "the guest never started: {st:?}");
    asker.abort();
    let s = session(&node.url).await;
    let waited = std::time::Instant::now();
    while st.memory_held > 0 && waited.elapsed() < std::time::Duration::from_secs(20) {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        st = sandbox_stats(&node.url).await;
    }
    assert_eq!(st.memory_held, 0, "the spinning guest still runs: {st:?}");
    assert_eq!(
        st.deadline_exceeded, 0,
        "stopped by its limit, not its asker: {st:?}"
    );
    assert!(waited.elapsed() < std::time::Duration::from_secs(20));
    // The node still answers.
    let want = pairs(&sql(&s, FILTER_MAP_SQL).await);
    assert!(!want.is_empty());
}

async fn sandbox_stats(url: &str) -> csd_runtime::sandbox::SandboxStats {
    let c = NodeClient::connect(url).await.unwrap();
    c.stats().await.unwrap().sandbox
}

/// A node on a device file (its folder, path and settings) with lineitem loaded, and
/// the filter_map job over it.
async fn filter_map_on_a_device_file()
-> (tempfile::TempDir, String, NodeConfig, RunningNode, WasmJob) {
    let dir = tempfile::tempdir().unwrap();
    let dev = dir.path().join("dev.img").display().to_string();
    let cfg = config(&dev);
    let node = start(&cfg).await;
    load_lineitem(&node.url).await;
    let j = job(
        "filter_map",
        FILTER_MAP_COLUMNS,
        Some("l_quantity < 30"),
        &[("mode", "AIR")],
    );
    (dir, dev, cfg, node, j)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_does_not_compile_again() {
    let (_dir, _, cfg, node, j) = filter_map_on_a_device_file().await;
    let first = session(&node.url).await.run_wasm(&j).await.unwrap();
    assert_eq!(sandbox_stats(&node.url).await.compiled, 1);
    node.shutdown().await.unwrap();
    let node = start(&cfg).await;
    let again = session(&node.url).await.run_wasm(&j).await.unwrap();
    assert_eq!(pairs(&again.batches), pairs(&first.batches));
    assert!(again.endpoints.iter().all(|e| !e.module_sent));
    let st = sandbox_stats(&node.url).await;
    assert_eq!((st.compiled, st.loaded_from_device), (0, 1), "{st:?}");
}

/// Flips a byte in the middle of the first extent of the object named `suffix`
/// under `.csd/wasm/` of the (stopped) node's device file.
async fn damage(url: &str, dev: &str, suffix: &str) -> impl FnOnce() + use<> {
    let objects = NodeClient::connect(url)
        .await
        .unwrap()
        .objects(".csd/wasm/")
        .await
        .unwrap();
    let o = objects
        .iter()
        .find(|o| o.name.ends_with(suffix))
        .unwrap_or_else(|| panic!("no {suffix} in {objects:?}"))
        .clone();
    let dev = dev.to_string();
    move || {
        let at = o.extents[0].lba * 4096 + (o.len / 2).min(4000);
        crate::patch_at(std::path::Path::new(&dev), at, 1, |b| b[0] ^= 0x5a);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_module_on_the_device_is_compiled_or_sent_again() {
    let (_dir, dev, cfg, node, j) = filter_map_on_a_device_file().await;
    let first = session(&node.url).await.run_wasm(&j).await.unwrap();
    // The compiled form damaged: the node compiles the module again from its bytes.
    let flip = damage(&node.url, &dev, ".cwasm").await;
    node.shutdown().await.unwrap();
    flip();
    let node = start(&cfg).await;
    let again = session(&node.url).await.run_wasm(&j).await.unwrap();
    assert_eq!(pairs(&again.batches), pairs(&first.batches));
    assert!(again.endpoints.iter().all(|e| !e.module_sent));
    let st = sandbox_stats(&node.url).await;
    assert_eq!((st.compiled, st.loaded_from_device), (1, 0), "{st:?}");
    // ...and writes it again: the next start loads it without compiling.
    node.shutdown().await.unwrap();
    let node = start(&cfg).await;
    session(&node.url).await.run_wasm(&j).await.unwrap();
    let st = sandbox_stats(&node.url).await;
    assert_eq!((st.compiled, st.loaded_from_device), (0, 1), "{st:?}");
    // Its bytes damaged: the node asks for them and the client sends them again.
    let flip = damage(&node.url, &dev, ".wasm").await;
    node.shutdown().await.unwrap();
    flip();
    let node = start(&cfg).await;
    let third = session(&node.url).await.run_wasm(&j).await.unwrap();
    assert_eq!(pairs(&third.batches), pairs(&first.batches));
    assert!(third.endpoints.iter().any(|e| e.module_sent));
    assert_eq!(sandbox_stats(&node.url).await.compiled, 1);
}

#[test]
fn a_module_error_keeps_its_kind() {
    let e = Error::DeadlineExceeded("x".into());
    assert_eq!(e.status_code(), StatusCode::DeadlineExceeded);
    assert_eq!(e.to_status().code(), tonic::Code::DeadlineExceeded);
}

/// A session with the example module's three SQL functions registered.
async fn session_with_functions(url: &str, pushdown: bool) -> CsdSession {
    let s = Cluster::connect(&[url.to_string()])
        .await
        .unwrap()
        .session(SessionOptions {
            pushdown,
            ..SessionOptions::default()
        })
        .await
        .unwrap();
    let module = guest("functions");
    for f in ["discounted", "word_count", "strict_sqrt"] {
        s.register_wasm_udf(f, &module, f).await.unwrap();
    }
    s
}

/// Rows as text, doubles rounded to 1e-6 relative (the order of a sum's terms
/// differs between plans).
pub(crate) fn rows_text(batches: &[RecordBatch]) -> Vec<String> {
    let mut out = Vec::new();
    for b in batches {
        for i in 0..b.num_rows() {
            let cells: Vec<String> = b
                .columns()
                .iter()
                .map(|c| match c.data_type() {
                    DataType::Float64 => {
                        let v = c.as_primitive::<Float64Type>().value(i);
                        format!("{:.6e}", v)
                    }
                    _ => arrow::util::display::array_value_to_string(c, i).unwrap(),
                })
                .collect();
            out.push(cells.join("|"));
        }
    }
    out.sort();
    out
}

const FUNCTIONS_SQL: &str = "SELECT l_returnflag, COUNT(*), SUM(discounted(l_extendedprice, l_discount)) \
     FROM lineitem WHERE word_count(l_comment) > 3 GROUP BY l_returnflag";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wasm_sql_functions_filter_at_the_node_with_the_local_answer() {
    let node = start(&config("emulated:mem")).await;
    load_lineitem(&node.url).await;
    let pushed = session_with_functions(&node.url, true).await;
    let local = session_with_functions(&node.url, false).await;

    // EXPLAIN shows the functions inside the fragment the nodes run.
    let explain = arrow::util::pretty::pretty_format_batches(
        &sql(&pushed, &format!("EXPLAIN {FUNCTIONS_SQL}")).await,
    )
    .unwrap()
    .to_string();
    let scan_line = explain
        .lines()
        .find(|l| l.contains("CsdScanExec"))
        .unwrap_or_else(|| panic!("no CsdScanExec in\n{explain}"));
    assert!(
        scan_line.contains("word_count") && scan_line.contains("discounted"),
        "{explain}"
    );

    let run = pushed.run(FUNCTIONS_SQL).await.unwrap();
    // One fragment: a partial aggregate reads the node's two partitions as one.
    assert_eq!(run.node_runs.len(), 1);
    assert!(
        run.node_runs.iter().all(|r| r.pushed_back.is_none()),
        "{:?}",
        run.node_runs
    );
    let got = rows_text(&run.batches);
    assert_eq!(got.len(), 3, "{got:?}");
    assert_eq!(
        got,
        rows_text(&local.run(FUNCTIONS_SQL).await.unwrap().batches)
    );
    // `discounted` equals the same arithmetic in SQL.
    let builtin = FUNCTIONS_SQL.replace(
        "discounted(l_extendedprice, l_discount)",
        "CAST(l_extendedprice AS DOUBLE) * (1 - CAST(l_discount AS DOUBLE))",
    );
    assert_eq!(got, rows_text(&sql(&pushed, &builtin).await));
    // The filter really ran at the node: it sent a few partial states, not lineitem.
    assert!(run.bytes_moved < 20_000, "{} bytes", run.bytes_moved);
    let st = sandbox_stats(&node.url).await;
    assert_eq!(st.compiled, 1, "one module, compiled once: {st:?}");
    assert_eq!(
        st.memory_held, 0,
        "instances dropped with their fragments: {st:?}"
    );

    // A function that refuses its input fails the query with its own message.
    let e = pushed
        .run("SELECT COUNT(*) FROM lineitem WHERE strict_sqrt(CAST(l_quantity AS DOUBLE) - 10) > 1")
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Some(StatusCode::InvalidArgument), "{e}");
    assert!(
        e.to_string().contains("strict_sqrt of a negative number"),
        "{e}"
    );
    // A call with the wrong arguments is the planner's error, before anything runs.
    let e = pushed
        .run("SELECT word_count(l_comment, 2) FROM lineitem")
        .await
        .unwrap_err();
    assert!(e.to_string().contains("takes 1 arguments"), "{e}");
    // The node still answers, and holds no guest memory.
    let again = pushed.run(FUNCTIONS_SQL).await.unwrap();
    assert_eq!(rows_text(&again.batches), got);
    assert_eq!(sandbox_stats(&node.url).await.memory_held, 0);

    // Bad registrations say what is wrong.
    let module = guest("functions");
    for (name, export, want) in [
        ("abs", "discounted", "built-in"),
        ("Bad-Name", "discounted", "not a usable name"),
        ("nope", "no_such_export", "no SQL function"),
    ] {
        let e = pushed
            .register_wasm_udf(name, &module, export)
            .await
            .unwrap_err();
        assert!(e.to_string().contains(want), "{name}: {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handed_back_fragments_run_their_wasm_functions_here() {
    let mut cfg = config("emulated:mem");
    cfg.policy = Policy::Never;
    let node = start(&cfg).await;
    load_lineitem(&node.url).await;
    let pushed = session_with_functions(&node.url, true).await;
    let run = pushed.run(FUNCTIONS_SQL).await.unwrap();
    assert!(run.node_runs.iter().all(|r| r.pushed_back.is_some()));
    let local = session_with_functions(&node.url, false).await;
    assert_eq!(
        rows_text(&run.batches),
        rows_text(&local.run(FUNCTIONS_SQL).await.unwrap().batches)
    );
    assert_eq!(sandbox_stats(&node.url).await.compiled, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_sandbox_answers_alike_and_refuses_past_its_slots() {
    use csd_runtime::memory::MemoryLedger;
    use csd_runtime::sandbox::{Sandbox, SandboxLimits};
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;
    let make = |pool: u32| {
        let limits = SandboxLimits {
            pool,
            memory: 64 << 20,
            ..SandboxLimits::default()
        };
        Arc::new(Sandbox::new(limits, MemoryLedger::new(1 << 30), None).unwrap())
    };
    let node = start(&config("emulated:mem")).await;
    load_lineitem(&node.url).await;
    let input = sql(
        &session(&node.url).await,
        "SELECT l_orderkey, l_extendedprice, l_discount, l_shipmode FROM lineitem WHERE l_quantity < 30",
    )
    .await;
    let args = BTreeMap::from([("mode".to_string(), "AIR".to_string())]);
    let cancel = Arc::new(AtomicBool::new(false));
    let module = guest("filter_map");
    let mut answers = Vec::new();
    for pool in [0, 1] {
        let s = make(pool);
        let m = s.compile(&module).await.unwrap();
        let mut g = s.instantiate(&m, &args, None, cancel.clone()).unwrap();
        let mut out = Vec::new();
        for b in &input {
            out.extend(g.batch(b).unwrap());
        }
        if pool == 1 {
            // Its one slot is taken: a second instance is refused, not queued
            // forever; the slot comes back when the first instance drops.
            let e = s.instantiate(&m, &args, None, cancel.clone()).unwrap_err();
            assert_eq!(e.status_code(), StatusCode::ResourceExhausted, "{e}");
            assert!(e.to_string().contains("--wasm-pool"), "{e}");
            drop(g);
            s.instantiate(&m, &args, None, cancel.clone()).unwrap();
        }
        answers.push(pairs(&out));
    }
    assert!(!answers[0].is_empty());
    assert_eq!(answers[0], answers[1]);
}

mod leases;
