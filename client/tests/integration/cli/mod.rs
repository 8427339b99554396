//! The `csd` binary as a user runs it: a separate process against a node.

use std::fmt::Write as _;
use std::path::Path;
use std::process::{Command, Output};

use csd_runtime::config::{ByteSize, NodeConfig};
use csd_runtime::node::{self, RunningNode};

async fn sql_node() -> RunningNode {
    let config = NodeConfig {
        device: "emulated:mem".into(),
        capacity: ByteSize::mib(256),
        listen: "127.0.0.1:0".into(),
        cpus: 2,
        ..NodeConfig::default()
    };
    let operators = csd_query_pushdown::registry_with(&config).unwrap();
    node::start_with(&config, operators).await.unwrap()
}

/// Runs `csd args…` off the runtime's threads (the node serves on them).
async fn csd(args: Vec<String>) -> Output {
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_csd"))
            .args(&args)
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

fn args(a: &[&str], node: &str) -> Vec<String> {
    let mut v: Vec<String> = a.iter().map(|s| s.to_string()).collect();
    v.extend(["--node".to_string(), node.to_string()]);
    v
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn write_csv(path: &Path) -> Vec<(String, String, i64)> {
    let mut rows = Vec::new();
    let mut csv = String::from("name,city,amount\n");
    for i in 0..300i64 {
        let name = format!("n{}", i % 7);
        let city = ["oslo", "lima", "pune"][(i % 3) as usize].to_string();
        let amount = (i * 37) % 101;
        writeln!(csv, "{name},{city},{amount}").unwrap();
        rows.push((name, city, amount));
    }
    std::fs::write(path, csv).unwrap();
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_scripts_with_comments_and_concatenation_answer_as_without_pushdown() {
    let node = sql_node().await;
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("t.csv");
    let rows = write_csv(&csv);
    let put = csd(args(
        &[
            "put",
            csv.to_str().unwrap(),
            "--table",
            "t",
            "--partition",
            "0",
        ],
        &node.url,
    ))
    .await;
    assert!(put.status.success(), "{:?}", text(&put));

    let script = dir.path().join("q.sql");
    std::fs::write(
        &script,
        "-- totals by city; pushed down\n\
         select city, sum(amount) as total from t where name <> 'x;y' group by city order by city;\n\
         /* concatenation; as a group key */\n\
         select city || '-' || name as k, count(*) as n from t group by 1 order by 1;\n\
         -- a trailing comment; with no statement after it\n",
    )
    .unwrap();
    let run = |push: bool| {
        let mut a = vec!["sql", "--format", "csv", "-f", script.to_str().unwrap()];
        if !push {
            a.push("--no-pushdown");
        }
        csd(args(&a, &node.url))
    };
    let pushed = run(true).await;
    let local = run(false).await;
    let (out, err) = text(&pushed);
    assert!(pushed.status.success(), "{err}");
    assert!(local.status.success(), "{:?}", text(&local));
    assert_eq!(out, text(&local).0, "pushdown changed the answer");

    let mut expected = String::from("city,total\n");
    for city in ["lima", "oslo", "pune"] {
        let total: i64 = rows.iter().filter(|r| r.1 == city).map(|r| r.2).sum();
        writeln!(expected, "{city},{total}").unwrap();
    }
    assert!(out.starts_with(&expected), "{out}");
    // 3 cities x 7 names, each group counted.
    let keys = out.lines().filter(|l| l.contains('-')).count();
    assert_eq!(keys, 21, "{out}");
    assert!(out.contains("lima-n0,"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_sql_and_unknown_tables_exit_with_a_clear_message() {
    let node = sql_node().await;
    let bad = csd(args(&["sql", "selec 1"], &node.url)).await;
    let (_, err) = text(&bad);
    assert_eq!(bad.status.code(), Some(2), "{err}");
    assert!(err.to_lowercase().contains("sql"), "{err}");
    assert!(!err.contains("panicked"), "{err}");

    let missing = csd(args(&["sql", "select * from nowhere"], &node.url)).await;
    let (_, err) = text(&missing);
    assert_eq!(missing.status.code(), Some(2), "{err}");
    assert!(err.contains("nowhere"), "{err}");

    let unreachable = csd(vec![
        "ls".into(),
        "--node".into(),
        "grpc://127.0.0.1:1".into(),
    ])
    .await;
    let (_, err) = text(&unreachable);
    assert_eq!(unreachable.status.code(), Some(3), "{err}");
}

/// `csd scrub` reads what a node stores and says it is whole; `csd stats` counts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrub_reads_every_object_back() {
    let node = sql_node().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("sales.csv");
    write_csv(&file);
    let put = csd(args(
        &[
            "put",
            file.to_str().unwrap(),
            "--table",
            "sales",
            "--partition",
            "a",
        ],
        &node.url,
    ))
    .await;
    assert!(put.status.success(), "{:?}", text(&put));
    let scrub = csd(args(&["scrub"], &node.url)).await;
    let (out, err) = text(&scrub);
    assert_eq!(scrub.status.code(), Some(0), "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["objects"], 1, "{out}");
    assert_eq!(report["damaged_count"], 0, "{out}");
    assert!(report["bytes"].as_u64().unwrap() > 0, "{out}");
    let stats = csd(args(&["stats"], &node.url)).await;
    let stats: serde_json::Value = serde_json::from_slice(&stats.stdout).unwrap();
    assert_eq!(stats["store"]["scrub"]["runs"], 1);
    assert_eq!(stats["store"]["corrupt_reads"], 0);
}

/// A node started with `--scrub-rate` reads back what it stores by itself, in the
/// background, and counts it; queries run meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_scrub_reads_what_the_node_holds() {
    let dir = tempfile::tempdir().unwrap();
    let config = |scrub: Option<ByteSize>| NodeConfig {
        device: format!("emulated:file={}", dir.path().join("dev.img").display()),
        capacity: ByteSize::mib(256),
        listen: "127.0.0.1:0".into(),
        cpus: 2,
        scrub_rate: scrub,
        ..NodeConfig::default()
    };
    let start = |c: NodeConfig| async move {
        let operators = csd_query_pushdown::registry_with(&c).unwrap();
        node::start_with(&c, operators).await.unwrap()
    };
    let node = start(config(None)).await;
    let file = dir.path().join("sales.csv");
    let rows = write_csv(&file);
    let put = csd(args(
        &[
            "put",
            file.to_str().unwrap(),
            "--table",
            "sales",
            "--partition",
            "a",
        ],
        &node.url,
    ))
    .await;
    assert!(put.status.success(), "{:?}", text(&put));
    let stored: u64 = node
        .state
        .node
        .tables
        .object_store()
        .list("")
        .iter()
        .map(|o| o.len)
        .sum();
    node.shutdown().await.unwrap();
    // Restarted over the same device with a background scrub.
    let node = start(config(Some(ByteSize::mib(64)))).await;
    let mut scrubbed = serde_json::Value::Null;
    for _ in 0..100 {
        let stats = csd(args(&["stats"], &node.url)).await;
        let stats: serde_json::Value = serde_json::from_slice(&stats.stdout).unwrap();
        scrubbed = stats["store"]["scrub"].clone();
        if scrubbed["runs"].as_u64() >= Some(1) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(scrubbed["runs"], 1, "{scrubbed}");
    assert_eq!(scrubbed["objects"], 1, "{scrubbed}");
    assert_eq!(scrubbed["bytes"].as_u64(), Some(stored), "{scrubbed}");
    assert_eq!(scrubbed["damaged_count"], 0, "{scrubbed}");
    let q = csd(args(
        &["sql", "--format", "csv", "SELECT count(*) AS n FROM sales"],
        &node.url,
    ))
    .await;
    assert_eq!(text(&q).0, format!("n\n{}\n", rows.len()), "{:?}", text(&q));
}

/// `csd csd_env…` with extra environment variables.
async fn csd_env(args: Vec<String>, env: Vec<(&'static str, String)>) -> Output {
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_csd"))
            .args(&args)
            .envs(env)
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

/// The deployment the README shows, as separate processes: `csd auth ca`, a tenants
/// file, `csd serve` with TLS and tenants, clients with a token, a SIGHUP re-read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secure_node_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = |f: &str| dir.path().join(f).display().to_string();
    let ca = csd(vec!["auth".into(), "ca".into(), d("certs")]).await;
    assert!(ca.status.success(), "{:?}", text(&ca));
    let hash = csd(vec!["auth".into(), "hash".into(), "s3cret".into()]).await;
    let digest = text(&hash).0.trim().to_string();
    assert_eq!(digest, csd_runtime::auth::token_digest("s3cret"));
    let tenants = |can: &str| {
        format!(
            "[[tenant]]\nname = \"etl\"\ntoken_sha256 = \"{digest}\"\ntables = [\"t\"]\ncan = [{can}]\n"
        )
    };
    std::fs::write(d("tenants.toml"), tenants("\"read\"")).unwrap();
    let mut serve = Command::new(env!("CARGO_BIN_EXE_csd"))
        .args(["serve", "--device", "emulated:mem", "--capacity", "256MiB"])
        .args(["--listen", "127.0.0.1:0", "--auth", &d("tenants.toml")])
        .args([
            "--tls-cert",
            &d("certs/node.pem"),
            "--tls-key",
            &d("certs/node.key"),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let url = {
        use std::io::BufRead;
        let mut line = String::new();
        std::io::BufReader::new(serve.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        line.split_whitespace()
            .find(|w| w.starts_with("grpc+tls://"))
            .unwrap_or_else(|| panic!("{line}"))
            .to_string()
    };
    let serve = Kill(serve);
    let csv = dir.path().join("t.csv");
    write_csv(&csv);
    let tls = |mut v: Vec<String>| {
        v.extend(["--tls-ca".to_string(), d("certs/ca.pem")]);
        v
    };
    let token = || vec![("CSD_TOKEN", "s3cret".to_string())];
    let put = || tls(args(&["put", csv.to_str().unwrap(), "--table", "t"], &url));
    // No token: exit 5 and a message saying what to do.
    let anon = csd(tls(args(&["ls"], &url))).await;
    assert_eq!(anon.status.code(), Some(5), "{:?}", text(&anon));
    assert!(
        text(&anon).1.contains("--token or CSD_TOKEN"),
        "{:?}",
        text(&anon)
    );
    // Read only: the put is refused, naming the permission.
    let refused = csd_env(put(), token()).await;
    assert_eq!(refused.status.code(), Some(5), "{:?}", text(&refused));
    assert!(text(&refused).1.contains("write"), "{:?}", text(&refused));
    // Granted write, re-read on SIGHUP, the same process serves it.
    std::fs::write(d("tenants.toml"), tenants("\"read\", \"write\"")).unwrap();
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(serve.0.id() as i32, libc::SIGHUP) };
    let mut stored = None;
    for _ in 0..50 {
        let o = csd_env(put(), token()).await;
        if o.status.success() {
            stored = Some(o);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(stored.is_some(), "the re-read tenants file never applied");
    let q = csd_env(
        tls(args(
            &["sql", "--format", "csv", "select count(*) as n from t"],
            &url,
        )),
        token(),
    )
    .await;
    assert_eq!(text(&q).0, "n\n300\n", "{:?}", text(&q));
    // A plain URL to a TLS node with TLS settings is refused before connecting.
    let plain = csd_env(
        tls(args(&["ls"], &url.replace("grpc+tls", "grpc"))),
        token(),
    )
    .await;
    assert_eq!(plain.status.code(), Some(2), "{:?}", text(&plain));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn csd_run_ships_a_module_and_prints_what_sql_prints() {
    let module = crate::wasm::guest_path("filter_map");
    assert!(
        module.exists(),
        "build the example guests first: scripts/build-wasm-examples.sh"
    );
    let node = sql_node().await;
    let dir = tempfile::tempdir().unwrap();
    let part = csd_client::demo::lineitem(0.01, 1, 1).unwrap();
    let file = dir.path().join("lineitem.parquet");
    let mut w = parquet::arrow::ArrowWriter::try_new(
        std::fs::File::create(&file).unwrap(),
        part[0].schema(),
        None,
    )
    .unwrap();
    for b in &part {
        w.write(b).unwrap();
    }
    w.close().unwrap();
    let put = csd(args(
        &["put", file.to_str().unwrap(), "--table", "lineitem"],
        &node.url,
    ))
    .await;
    assert!(put.status.success(), "{:?}", text(&put));
    let run = csd(args(
        &[
            "run",
            "--wasm",
            module.to_str().unwrap(),
            "--table",
            "lineitem",
            "--columns",
            "l_orderkey,l_extendedprice,l_discount,l_shipmode",
            "--where",
            "l_quantity < 5",
            "--arg",
            "mode=MAIL",
            "--format",
            "csv",
        ],
        &node.url,
    ))
    .await;
    let (out, err) = text(&run);
    assert!(run.status.success(), "{out}\n{err}");
    assert!(err.contains("module sent"), "{err}");
    let sql = csd(args(
        &[
            "sql",
            "--format",
            "csv",
            "SELECT l_orderkey, ROUND(CAST(l_extendedprice AS DOUBLE) * (1 - CAST(l_discount AS DOUBLE)), 4) AS revenue \
             FROM lineitem WHERE l_quantity < 5 AND l_shipmode = 'MAIL' ORDER BY 1, 2",
        ],
        &node.url,
    ))
    .await;
    assert!(sql.status.success(), "{:?}", text(&sql));
    let rows = |s: &str| {
        let mut v: Vec<(i64, f64)> = s
            .lines()
            .skip(1)
            .map(|l| {
                let (k, r) = l.split_once(',').unwrap();
                (k.parse().unwrap(), r.parse::<f64>().unwrap())
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
        v
    };
    let (got, want) = (rows(&out), rows(&text(&sql).0));
    assert!(!want.is_empty());
    assert_eq!(got.len(), want.len());
    // SQL rounded to 4 places; the module's doubles are not.
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.0, w.0);
        assert!((g.1 - w.1).abs() < 1e-3, "{g:?} vs {w:?}");
    }
    // A bad argument is the user's error, said plainly, exit code 2.
    let bad = csd(args(
        &[
            "run",
            "--wasm",
            module.to_str().unwrap(),
            "--table",
            "lineitem",
            "--arg",
            "mode",
        ],
        &node.url,
    ))
    .await;
    assert_eq!(bad.status.code(), Some(2), "{:?}", text(&bad));
    assert!(text(&bad).1.contains("KEY=VALUE"), "{:?}", text(&bad));

    // Wasm SQL functions from the command line, read from a SQL file with a
    // comment: pushed and not pushed print the same rows.
    let functions = module.with_file_name("functions.wasm");
    let wc = format!("word_count={}:word_count", functions.display());
    let disc = format!("discounted={}", functions.display());
    let q = dir.path().join("q.sql");
    std::fs::write(
        &q,
        "-- words per comment, priced\nSELECT l_linestatus, COUNT(*) AS n, \
         ROUND(SUM(discounted(l_extendedprice, l_discount)), 2) AS revenue \
         FROM lineitem WHERE word_count(l_comment) > 4 GROUP BY l_linestatus ORDER BY 1;\n",
    )
    .unwrap();
    let run_fn = |extra: &'static [&'static str]| {
        let mut a = vec![
            "sql",
            "--format",
            "csv",
            "--wasm-fn",
            &wc,
            "--wasm-fn",
            &disc,
        ];
        a.extend_from_slice(extra);
        a.extend_from_slice(&["-f", q.to_str().unwrap()]);
        csd(args(&a, &node.url))
    };
    let pushed = run_fn(&[]).await;
    let here = run_fn(&["--no-pushdown"]).await;
    assert!(pushed.status.success(), "{:?}", text(&pushed));
    assert!(here.status.success(), "{:?}", text(&here));
    assert_eq!(text(&pushed).0, text(&here).0);
    assert_eq!(text(&pushed).0.lines().count(), 3, "{:?}", text(&pushed));
    let bad = csd(args(&["sql", "--wasm-fn", "nope", "SELECT 1"], &node.url)).await;
    assert_eq!(bad.status.code(), Some(2), "{:?}", text(&bad));
    assert!(
        text(&bad).1.contains("NAME=FILE.wasm:EXPORT"),
        "{:?}",
        text(&bad)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_keep_prints_references_that_get_resolves_and_release_frees() {
    let node = sql_node().await;
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("t.csv");
    write_csv(&csv);
    for p in ["0", "1"] {
        let put = csd(args(
            &[
                "put",
                csv.to_str().unwrap(),
                "--table",
                "t",
                "--partition",
                p,
            ],
            &node.url,
        ))
        .await;
        assert!(put.status.success(), "{:?}", text(&put));
    }
    let q = "select name, city, amount from t where amount > 50 -- the big ones";
    let kept = csd(args(&["sql", "--keep", "--ttl", "2m", q], &node.url)).await;
    let (out, err) = text(&kept);
    assert!(kept.status.success(), "{err}");
    assert_eq!(out.lines().count(), 2, "one reference per partition: {out}");
    for line in out.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["location"], node.url.as_str(), "{line}");
        assert!(
            v["ticket"].as_str().is_some_and(|t| !t.is_empty()),
            "{line}"
        );
        assert!(
            v["expires"].as_str().is_some_and(|t| t.ends_with('Z')),
            "{line}"
        );
    }
    assert!(err.contains("kept"), "{err}");
    let refs = dir.path().join("refs.jsonl");
    std::fs::write(&refs, &out).unwrap();

    let sorted = |s: &str| {
        let mut l: Vec<String> = s.lines().map(String::from).collect();
        l.sort();
        l
    };
    let got = csd(vec![
        "get".into(),
        refs.to_str().unwrap().into(),
        "--format".into(),
        "csv".into(),
    ])
    .await;
    assert!(got.status.success(), "{:?}", text(&got));
    let local = csd(args(
        &["sql", "--no-pushdown", "--format", "csv", q],
        &node.url,
    ))
    .await;
    assert!(local.status.success(), "{:?}", text(&local));
    // Two partitions of the same rows: each row twice, the header once per file.
    let got_rows: Vec<String> = sorted(&text(&got).0)
        .into_iter()
        .filter(|l| l != "name,city,amount")
        .collect();
    let local_rows: Vec<String> = sorted(&text(&local).0)
        .into_iter()
        .filter(|l| l != "name,city,amount")
        .collect();
    assert!(!local_rows.is_empty());
    assert_eq!(got_rows, local_rows, "kept answer differs from the query's");
    // Into a file instead (Parquet, or Arrow IPC by extension): the same rows.
    for name in ["kept.parquet", "kept.arrow"] {
        let file = dir.path().join(name);
        let out = csd(vec![
            "get".into(),
            refs.to_str().unwrap().into(),
            "--out".into(),
            file.to_str().unwrap().into(),
        ])
        .await;
        assert!(out.status.success(), "{:?}", text(&out));
        let rows: usize = if name.ends_with(".arrow") {
            arrow::ipc::reader::FileReader::try_new(std::fs::File::open(&file).unwrap(), None)
                .unwrap()
                .map(|b| b.unwrap().num_rows())
                .sum()
        } else {
            parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(
                std::fs::File::open(&file).unwrap(),
            )
            .unwrap()
            .build()
            .unwrap()
            .map(|b| b.unwrap().num_rows())
            .sum()
        };
        assert_eq!(rows, got_rows.len(), "{name}");
        assert!(text(&out).1.contains("rows written to"), "{:?}", text(&out));
    }

    let listed = csd(args(&["refs"], &node.url)).await;
    assert_eq!(text(&listed).0.lines().count(), 2, "{:?}", text(&listed));
    let released = csd(vec!["release".into(), refs.to_str().unwrap().into()]).await;
    assert!(released.status.success(), "{:?}", text(&released));
    let again = csd(vec!["get".into(), refs.to_str().unwrap().into()]).await;
    assert!(!again.status.success());
    assert!(
        text(&again).1.contains("expired, was released"),
        "{:?}",
        text(&again)
    );
    let agg = csd(args(
        &[
            "sql",
            "--keep",
            "select count(*) from t a join t b on a.name = b.name",
        ],
        &node.url,
    ))
    .await;
    assert!(!agg.status.success());
    assert!(
        text(&agg).1.contains("does not push whole"),
        "{:?}",
        text(&agg)
    );
}

/// A child process killed (and reaped) when dropped.
struct Kill(std::process::Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

mod busy_copies;
mod crashes;
mod ml_failover;
mod module_copies;
mod onnx;
mod processes;
mod replicas;
#[cfg(feature = "spdk")]
mod spdk;
