//! `csd` processes that outlive their callers: nodes killed or with their stdout
//! closed, leases and invocations, `csd worker` processes.

use super::*;

/// `csd ARGS…` as its own process, and the first `grpc://` URL its first line
/// prints (a server saying where it listens).
fn spawn_listening(args: &[&str]) -> (std::process::Child, String) {
    spawn_listening_with(args, &[])
}

/// [`spawn_listening`] with environment variables set.
pub(super) fn spawn_listening_with(
    args: &[&str],
    env: &[(&str, &str)],
) -> (std::process::Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_csd"))
        .args(args)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    use std::io::BufRead;
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("grpc://"))
        .unwrap_or_else(|| panic!("{line}"))
        .to_string();
    (child, url)
}

/// `csd serve` on the drive file `dir/name` (kept across restarts) as its own
/// process, killed when dropped, and its URL.
pub(super) fn serve_on_drive(dir: &Path, name: &str) -> (Kill, String) {
    let (child, url) = spawn_serve(&format!("uring:{}", dir.join(name).display()));
    (Kill(child), url)
}

/// `csd ARGS --node U…` for every node of `urls`.
pub(super) fn on_all(a: &[&str], urls: &[String]) -> Vec<String> {
    let mut v: Vec<String> = a.iter().map(|s| s.to_string()).collect();
    for u in urls {
        v.extend(["--node".to_string(), u.clone()]);
    }
    v
}

/// `csd serve` on `device` as its own process, and the URL it prints.
pub(super) fn spawn_serve(device: &str) -> (std::process::Child, String) {
    spawn_listening(&[
        "serve",
        "--device",
        device,
        "--capacity",
        "256MiB",
        "--listen",
        "127.0.0.1:0",
    ])
}

/// A launcher that reads the node's address and closes the pipe (as
/// `spawn_listening` does) must not stop it: its later status lines go nowhere, it
/// serves on, and Ctrl-C still shuts it down cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_stdout_was_closed_serves_on_and_stops_cleanly() {
    let (mut node, url) = spawn_listening(&[
        "serve",
        "--device",
        "emulated:mem",
        "--capacity",
        "256MiB",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("t.csv");
    write_csv(&csv);
    let put = csd(args(&["put", csv.to_str().unwrap(), "--table", "t"], &url)).await;
    assert!(put.status.success(), "{:?}", text(&put));
    let q = csd(args(&["sql", "select count(*) from t"], &url)).await;
    assert!(q.status.success(), "{:?}", text(&q));
    assert!(node.try_wait().unwrap().is_none(), "the node stopped");
    // SAFETY: kill has no memory preconditions; the pid is our child's.
    assert_eq!(unsafe { libc::kill(node.id() as i32, libc::SIGINT) }, 0);
    let status = tokio::task::spawn_blocking(move || node.wait().unwrap())
        .await
        .unwrap();
    assert!(status.success(), "the node ended with {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn references_outlive_a_kill_9_and_expired_ones_are_gone_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let device = format!("emulated:file={}", dir.path().join("dev").display());
    let (mut first, url) = spawn_serve(&device);
    let csv = dir.path().join("t.csv");
    write_csv(&csv);
    let put = csd(args(&["put", csv.to_str().unwrap(), "--table", "t"], &url)).await;
    assert!(put.status.success(), "{:?}", text(&put));
    let q = "select name, amount from t where city = 'oslo'";
    let keep = |ttl: &'static str| csd(args(&["sql", "--keep", "--ttl", ttl, q], &url));
    let long = keep("10m").await;
    let short = keep("2s").await;
    assert!(
        long.status.success() && short.status.success(),
        "{:?}",
        text(&long)
    );
    let local = csd(args(&["sql", "--format", "csv", q], &url)).await;
    let expected = text(&local).0;
    first.kill().unwrap(); // SIGKILL
    first.wait().unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;

    let (second, url2) = spawn_serve(&device);
    let _second = Kill(second);
    let moved = |o: &Output| text(o).0.replace(&url, &url2);
    let (long_refs, short_refs) = (dir.path().join("long"), dir.path().join("short"));
    std::fs::write(&long_refs, moved(&long)).unwrap();
    std::fs::write(&short_refs, moved(&short)).unwrap();
    let get = |f: &Path| {
        csd(vec![
            "get".into(),
            f.display().to_string(),
            "--format".into(),
            "csv".into(),
        ])
    };
    let got = get(&long_refs).await;
    assert!(got.status.success(), "{:?}", text(&got));
    let got = text(&got).0;
    let mut a: Vec<&str> = got.lines().collect();
    let mut b: Vec<&str> = expected.lines().collect();
    a.sort();
    b.sort();
    assert_eq!(a, b, "the kept answer survived the kill");
    let gone = get(&short_refs).await;
    assert!(!gone.status.success());
    assert!(
        text(&gone).1.contains("expired, was released"),
        "{:?}",
        text(&gone)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn csd_lease_and_invoke_call_a_function_on_a_leased_slot() {
    let module = crate::wasm::guest_path("functions");
    assert!(
        module.exists(),
        "build the example guests first: scripts/build-wasm-examples.sh"
    );
    let node = sql_node().await;
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("args.arrow");
    let batch = arrow::record_batch::RecordBatch::try_from_iter([
        (
            "price",
            std::sync::Arc::new(arrow::array::Float64Array::from(vec![100.0, 8.0]))
                as arrow::array::ArrayRef,
        ),
        (
            "discount",
            std::sync::Arc::new(arrow::array::Float64Array::from(vec![0.25, 0.5]))
                as arrow::array::ArrayRef,
        ),
    ])
    .unwrap();
    let mut w = arrow::ipc::writer::FileWriter::try_new(
        std::fs::File::create(&input).unwrap(),
        &batch.schema(),
    )
    .unwrap();
    w.write(&batch).unwrap();
    w.finish().unwrap();
    let lease = csd(args(
        &["lease", "--slots", "1", "--seconds", "30"],
        &node.url,
    ))
    .await;
    assert!(lease.status.success(), "{:?}", text(&lease));
    let info: serde_json::Value = serde_json::from_str(text(&lease).0.trim()).unwrap();
    let id = info["id"].as_str().unwrap().to_string();
    let invoke = |id: String| {
        csd(args(
            &[
                "invoke",
                &id,
                "--wasm",
                module.to_str().unwrap(),
                "--export",
                "discounted",
                "--input",
                input.to_str().unwrap(),
                "--format",
                "csv",
            ],
            &node.url,
        ))
    };
    let out = invoke(id.clone()).await;
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stdout, "discounted\n75.0\n4.0\n", "{stderr}");
    assert!(stderr.contains("cold"), "{stderr}");
    let hot = invoke(id.clone()).await;
    assert!(text(&hot).1.contains("hot"), "{:?}", text(&hot));
    // Pushed SQL runs on the lease too, past the queue, with the same answer.
    let nums = arrow::record_batch::RecordBatch::try_from_iter([(
        "x",
        std::sync::Arc::new(arrow::array::Int64Array::from_iter_values(0..1000))
            as arrow::array::ArrayRef,
    )])
    .unwrap();
    csd_runtime::node_client::NodeClient::connect(&node.url)
        .await
        .unwrap()
        .put(
            "nums",
            "0",
            nums.schema(),
            futures::stream::iter([Ok(nums)]),
        )
        .await
        .unwrap();
    let q = "SELECT count(*) AS n, sum(x) AS s FROM nums WHERE x >= 10";
    let plain = csd(args(&["sql", "--format", "csv", q], &node.url)).await;
    let leased = csd(args(
        &["sql", "--format", "csv", "--lease", &id, q],
        &node.url,
    ))
    .await;
    assert!(leased.status.success(), "{:?}", text(&leased));
    assert_eq!(text(&leased).0, "n,s\n990,499455\n");
    assert_eq!(text(&leased).0, text(&plain).0);
    assert!(
        text(&leased).1.contains("1 on leases"),
        "{:?}",
        text(&leased)
    );
    assert!(!text(&plain).1.contains("on leases"), "{:?}", text(&plain));
    let released = csd(args(&["lease", "--release", &id], &node.url)).await;
    assert!(released.status.success(), "{:?}", text(&released));
    let gone = invoke(id).await;
    assert!(!gone.status.success());
    assert!(text(&gone).1.contains("not held here"), "{:?}", text(&gone));
}

/// `csd worker` as its own process, and the URL it prints. It keeps compiled Wasm
/// modules in memory only, so it has none it was not sent.
fn spawn_worker() -> (std::process::Child, String) {
    spawn_listening_with(
        &["worker", "--listen", "127.0.0.1:0"],
        &[("CSD_WASM_CACHE", "")],
    )
}

/// `csd sql --workers` with two `csd worker` processes: the same CSV as one
/// process, for aggregates, joins and top-k, and with a Wasm SQL function the
/// workers call above a join; with a worker killed (-9), the query fails in bounded
/// time with a message that names the workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_on_worker_processes_answers_as_one_process_and_a_dead_worker_is_named() {
    let (a, b) = (sql_node().await, sql_node().await);
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("t.csv");
    write_csv(&csv);
    for (node, part) in [(&a.url, "0"), (&b.url, "1")] {
        let put = csd(args(
            &[
                "put",
                csv.to_str().unwrap(),
                "--table",
                "t",
                "--partition",
                part,
            ],
            node,
        ))
        .await;
        assert!(put.status.success(), "{:?}", text(&put));
    }
    let (w1, u1) = spawn_worker();
    let (w2, u2) = spawn_worker();
    let mut w1 = Kill(w1);
    let _w2 = Kill(w2);
    let workers = format!("{u1},{u2}");
    let queries = [
        "select city, sum(amount) s, count(*) n from t group by city order by city",
        "select x.name, count(*) c from t x join t y on x.name = y.name \
         where x.city = 'oslo' and y.amount > 50 group by x.name order by x.name",
        "select name, amount from t where city <> 'lima' order by amount desc, name limit 7",
    ];
    let module = dir.path().join("functions.wasm");
    std::fs::write(&module, crate::wasm::guest("functions")).unwrap();
    let wasm_fn = format!("wc={}:word_count", module.display());
    let run = |q: &str, workers: Option<&str>| {
        let mut v = vec![
            "sql".to_string(),
            "--format".into(),
            "csv".into(),
            "--node".into(),
            a.url.clone(),
            "--node".into(),
            b.url.clone(),
        ];
        if q.contains("wc(") {
            v.extend(["--wasm-fn".into(), wasm_fn.clone()]);
        }
        if let Some(w) = workers {
            v.extend(["--workers".into(), w.to_string()]);
        }
        v.push(q.to_string());
        csd(v)
    };
    let queries = [
        queries[0],
        queries[1],
        queries[2],
        "select x.city, wc(x.name || ' ' || repeat('a ', CAST(y.amount % 5 AS INT))) w, \
         count(*) c from t x join t y on x.name = y.name where x.amount > 80 \
         group by 1, 2 order by 1, 2",
    ];
    for q in queries {
        let here = run(q, None).await;
        let there = run(q, Some(&workers)).await;
        assert!(here.status.success(), "{:?}", text(&here));
        assert!(there.status.success(), "{q}: {:?}", text(&there));
        assert_eq!(text(&here).0, text(&there).0, "{q}");
        assert!(
            text(&there).1.contains("stages on 2 workers"),
            "{:?}",
            text(&there)
        );
        assert!(!text(&there).0.trim().is_empty());
    }
    w1.0.kill().unwrap();
    w1.0.wait().unwrap();
    let started = std::time::Instant::now();
    let dead = run(queries[1], Some(&workers)).await;
    assert!(!dead.status.success(), "{:?}", text(&dead));
    assert!(started.elapsed() < std::time::Duration::from_secs(60));
    let err = text(&dead).1;
    println!("{err}");
    assert!(err.contains(&u1) && err.contains("worker"), "{err}");
}

/// All 22 TPC-H queries (SF 0.01, two nodes) with their stages on two and on three
/// `csd worker` processes (three: more workers than a scan has endpoints): the same
/// rows as the same queries without pushdown in one process, each answered in
/// bounded time even where a planned task never runs (Q17 at this scale has an empty
/// build side, so its probe side's stages stop early), with bytes counted whenever
/// every task reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tpch_on_worker_processes_equals_no_pushdown() {
    use csd_query_pushdown::{Cluster, SessionOptions, Workers};
    let (a, b) = (sql_node().await, sql_node().await);
    let urls = vec![a.url.clone(), b.url.clone()];
    let mut clients = Vec::new();
    for u in &urls {
        clients.push(
            csd_runtime::node_client::NodeClient::connect(u)
                .await
                .unwrap(),
        );
    }
    csd_testbed::tpch::load(&clients, 0.01, 1, |_, _| {})
        .await
        .unwrap();
    let spawned: Vec<_> = (0..3).map(|_| spawn_worker()).collect();
    let mut worker_urls = Vec::new();
    let mut _kill = Vec::new();
    for (child, url) in spawned {
        _kill.push(Kill(child));
        worker_urls.push(url);
    }
    let cluster = Cluster::connect(&urls).await.unwrap();
    let plain = cluster
        .session(SessionOptions {
            pushdown: false,
            ..SessionOptions::default()
        })
        .await
        .unwrap();
    let mut want = Vec::new();
    for (_, sql) in csd_testbed::tpch::QUERIES {
        want.push(crate::wasm::rows_text(
            &plain.run(sql).await.unwrap().batches,
        ));
    }
    for n in [2, 3] {
        let staged = cluster
            .distributed_session(
                SessionOptions::default(),
                &Workers::new(worker_urls[..n].iter().cloned()),
            )
            .await
            .unwrap();
        let mut distributed = 0;
        for ((q, sql), want) in csd_testbed::tpch::QUERIES.iter().zip(&want) {
            let run = tokio::time::timeout(std::time::Duration::from_secs(20), staged.run(sql))
                .await
                .unwrap_or_else(|_| panic!("Q{q} on {n} workers: no answer in 20 s"))
                .unwrap_or_else(|e| panic!("Q{q} on {n} workers: {e}"));
            assert_eq!(&crate::wasm::rows_text(&run.batches), want, "Q{q} on {n}");
            assert!(
                !run.metrics_complete || run.bytes_moved > 0,
                "Q{q} on {n}: no bytes counted"
            );
            if run.plan_with_metrics().contains("Network") {
                distributed += 1;
            }
        }
        assert!(
            distributed >= 15,
            "only {distributed} of 22 plans had stages on {n} workers"
        );
    }
}
