//! Does `--memory` bound the node under everything at once? One `csd serve` process
//! (`--memory 256MiB --cpus 1` by default, a file-backed device) holds TPC-H; for
//! `--secs`, six compute-tier clients run TPC-H queries with pushdown, three writers
//! store tables and delete older ones, and one scanner streams lineitem whole. The
//! node's resident memory (`VmRSS` of its process, every 5 ms) is held against the
//! budget. Every answer is checked against the same query without pushdown, every
//! scan's rows counted; then the node is killed with SIGKILL, restarted on its
//! device, and every table a writer was told was stored (and not deleted) must be
//! there with its rows, every deleted one gone.
//!
//! `cargo run --release -p csd-benches --bin mixed -- [--secs 90] [--memory 256MiB]`
//! (build `csd` first: `cargo build --release -p csd-client`).
//!
//! With `--guest aarch64` the node runs in a CSD-shaped arm64 QEMU guest (4 Cortex-A53
//! cores, 2 GiB, NVMe passthrough; `scripts/setup-qemu.sh --arch aarch64`,
//! `scripts/build-aarch64.sh`) instead: its resident memory is sampled from its own
//! stats every 100 ms, and the kill is the whole machine's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use csd_benches::{default_json_path, write_json};
use csd_query_pushdown::{Cluster, SessionOptions};
use csd_runtime::config::ByteSize;
use csd_runtime::node_client::NodeClient;
use csd_runtime::protocol::StatusCode;
use csd_testbed::guest::{Arch, Guest, GuestSpec, default_binary_for};
use csd_testbed::tpch;
use futures::TryStreamExt;
use serde::Serialize;

#[derive(Parser)]
struct Args {
    /// Seconds of mixed load.
    #[arg(long, default_value_t = 90)]
    secs: u64,
    /// TPC-H scale factor of the tables queried and scanned.
    #[arg(long, default_value_t = 0.5)]
    scale: f64,
    /// The node's `--memory`.
    #[arg(long, default_value = "256MiB")]
    memory: ByteSize,
    /// The node's `--cpus`.
    #[arg(long, default_value_t = 1)]
    cpus: usize,
    /// Query clients.
    #[arg(long, default_value_t = 6)]
    clients: usize,
    /// Writers (store a table, delete an older one).
    #[arg(long, default_value_t = 3)]
    writers: usize,
    /// Scanners (stream lineitem whole).
    #[arg(long, default_value_t = 1)]
    scanners: usize,
    /// Extra `csd serve` arguments (space-separated).
    #[arg(long, default_value = "")]
    serve_args: String,
    /// Device file directory (default: the target directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// JSON output path.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Run the node in a QEMU guest of this machine (`x86_64` or `aarch64`: a
    /// CSD-shaped arm64 guest) instead of as a process here.
    #[arg(long, value_parser = parse_arch)]
    guest: Option<Arch>,
}

fn parse_arch(s: &str) -> Result<Arch, String> {
    match s {
        "x86_64" => Ok(Arch::X86_64),
        "aarch64" => Ok(Arch::Aarch64),
        _ => Err(format!("{s}: x86_64 or aarch64")),
    }
}

/// TPC-H queries the clients take turns on.
const QUERIES: [u32; 8] = [1, 3, 5, 6, 10, 12, 14, 19];

#[derive(Serialize, Debug, Default)]
struct Figures {
    budget_bytes: u64,
    idle_rss_bytes: u64,
    peak_rss_bytes: u64,
    peak_hwm_bytes: Option<u64>,
    queries: u64,
    queries_failed: Vec<String>,
    queries_wrong: u64,
    fragments_pushed_back: u64,
    puts: u64,
    /// Puts refused with RESOURCE_EXHAUSTED (retried after the hint; nothing stored).
    puts_refused: u64,
    puts_failed: Vec<String>,
    deletes: u64,
    scans: u64,
    scans_refused: u64,
    scans_wrong: u64,
    scans_failed: Vec<String>,
    /// After SIGKILL and a restart: acknowledged tables missing or short, deleted
    /// tables back.
    lost: Vec<String>,
    survived: u64,
}

fn spawn_node(args: &Args, device: &Path, format: bool) -> (Child, String) {
    let csd = csd_benches::csd_binary();
    let mut cmd = Command::new(&csd);
    cmd.args(["serve", "--listen", "127.0.0.1:0"])
        .args(["--cpus", &args.cpus.to_string()])
        .args(["--memory", &args.memory.to_string()])
        .args(["--capacity", "8GiB"])
        .arg("--device")
        .arg(device)
        .args(args.serve_args.split_whitespace())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped());
    if format {
        cmd.arg("--format");
    }
    let mut child = cmd.spawn().unwrap_or_else(|e| {
        panic!(
            "starting {}: {e} (build it: cargo build --release -p csd-client)",
            csd.display()
        )
    });
    let url = csd_benches::node_url(&mut child);
    (child, url)
}

/// The node under load: a `csd serve` process here, or a QEMU guest.
enum Node {
    Process(Child),
    Guest(Box<Guest>),
}

impl Node {
    /// Starts a node on a fresh device in `dir`; its URL.
    async fn start(args: &Args, dir: &Path) -> (Node, String) {
        let device = dir.join("node.img");
        let Some(arch) = args.guest else {
            let (child, url) = spawn_node(args, &device, true);
            return (Node::Process(child), url);
        };
        let binary = default_binary_for(arch).unwrap_or_else(|e| panic!("{e}"));
        let mut spec = GuestSpec::csd(binary, device, dir.to_path_buf());
        spec.arch = arch;
        spec.disk_bytes = 4 << 30;
        spec.node_args = vec![
            "--cpus".into(),
            args.cpus.to_string(),
            "--memory".into(),
            args.memory.to_string(),
        ];
        spec.node_args
            .extend(args.serve_args.split_whitespace().map(String::from));
        let g = Guest::boot(spec).await.unwrap_or_else(|e| panic!("{e}"));
        let url = g.url.clone();
        (Node::Guest(Box::new(g)), url)
    }

    fn pid(&self) -> Option<u32> {
        match self {
            Node::Process(c) => Some(c.id()),
            Node::Guest(_) => None,
        }
    }

    /// SIGKILL: the process's, or the whole machine's.
    fn kill(&mut self) {
        match self {
            Node::Process(c) => {
                let _ = c.kill();
                let _ = c.wait();
            }
            Node::Guest(g) => g.kill(),
        }
    }

    /// Starts the node again on the same device; its URL.
    async fn restart(&mut self, args: &Args, dir: &Path) -> String {
        match self {
            Node::Process(c) => {
                let (child, url) = spawn_node(args, &dir.join("node.img"), false);
                *c = child;
                url
            }
            Node::Guest(g) => {
                g.restart().await.unwrap_or_else(|e| panic!("{e}"));
                g.url.clone()
            }
        }
    }
}

/// The node's highest resident memory while the load runs: its process's, sampled
/// every 5 ms from here, or a guest's, from its stats every 100 ms.
enum Peak {
    Process(csd_benches::RssPeak),
    Stats(
        tokio::task::JoinHandle<u64>,
        Arc<std::sync::atomic::AtomicBool>,
    ),
}

impl Peak {
    fn start(node: &Node, client: &NodeClient, floor: u64) -> Peak {
        if let Some(pid) = node.pid() {
            return Peak::Process(csd_benches::RssPeak::start(pid, floor));
        }
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (client, stop) = (client.clone(), done.clone());
        Peak::Stats(
            tokio::spawn(async move {
                let mut peak = floor;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Ok(s) = client.stats().await {
                        peak = peak.max(s.resident_bytes.unwrap_or(0));
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                peak
            }),
            done,
        )
    }

    async fn stop(self) -> u64 {
        match self {
            Peak::Process(p) => p.stop(),
            Peak::Stats(task, done) => {
                done.store(true, std::sync::atomic::Ordering::Relaxed);
                task.await.expect("the RSS sampler")
            }
        }
    }
}

fn refused(e: &csd_runtime::node_client::Error) -> bool {
    e.status_code() == StatusCode::ResourceExhausted
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let dir = csd_benches::scratch_dir(args.dir.clone()).expect("scratch dir");
    let (mut node, url) = Node::start(&args, dir.path()).await;
    let client = NodeClient::connect(&url).await.expect("connect");
    eprintln!("loading TPC-H SF {} into the node", args.scale);
    tpch::load(std::slice::from_ref(&client), args.scale, 2, |_, _| {})
        .await
        .expect("load");
    let lineitem_rows = client.table("lineitem").await.expect("lineitem").rows;
    let cluster = Cluster::connect(std::slice::from_ref(&url))
        .await
        .expect("cluster");
    let with = Arc::new(
        cluster
            .session(SessionOptions::default())
            .await
            .expect("session"),
    );
    let without = cluster
        .session(SessionOptions {
            pushdown: false,
            ..SessionOptions::default()
        })
        .await
        .expect("session");
    eprintln!("answers without pushdown");
    let mut expected = BTreeMap::new();
    for q in QUERIES {
        let r = without
            .run(tpch::query(q).expect("query"))
            .await
            .expect("no pushdown");
        expected.insert(q, csd_benches::canonical_rows(&r.batches));
    }
    let expected = Arc::new(expected);
    // A writer's table: a slice of orders, 50,000 rows.
    let (oschema, obatches) = tpch::generate("orders", args.scale, 1, 8).expect("orders");

    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle = match node.pid() {
        Some(pid) => {
            let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
            csd_benches::proc_status_bytes(pid, "VmRSS:").unwrap_or(0)
        }
        None => {
            let s = client.stats().await.expect("stats");
            s.resident_bytes.unwrap_or(0)
        }
    };
    let figures = Arc::new(Mutex::new(Figures {
        budget_bytes: args.memory.0,
        idle_rss_bytes: idle,
        ..Figures::default()
    }));
    let rss = Peak::start(&node, &client, idle);
    let until = Instant::now() + Duration::from_secs(args.secs);
    eprintln!(
        "{} query clients, {} writers, {} scanners for {} s against --memory {}",
        args.clients, args.writers, args.scanners, args.secs, args.memory
    );
    let mut tasks = Vec::new();
    for c in 0..args.clients {
        let (s, expected, figures) = (with.clone(), expected.clone(), figures.clone());
        tasks.push(tokio::spawn(async move {
            let mut k = c;
            while Instant::now() < until {
                let q = QUERIES[k % QUERIES.len()];
                k += 1;
                let r = s.run(tpch::query(q).expect("query")).await;
                let mut f = figures.lock().expect("figures");
                match r {
                    Ok(r) => {
                        f.queries += 1;
                        f.fragments_pushed_back +=
                            r.node_runs.iter().filter(|n| n.work_pushed_back()).count() as u64;
                        if csd_benches::canonical_rows(&r.batches) != expected[&q] {
                            f.queries_wrong += 1;
                        }
                    }
                    Err(e) => f.queries_failed.push(format!("Q{q}: {e}")),
                }
            }
        }));
    }
    // What writers were told: stored (table → rows) and deleted.
    let stored = Arc::new(Mutex::new(BTreeMap::<String, u64>::new()));
    let deleted = Arc::new(Mutex::new(Vec::<String>::new()));
    for w in 0..args.writers {
        let (client, figures) = (client.clone(), figures.clone());
        let (stored, deleted) = (stored.clone(), deleted.clone());
        let (schema, batches) = (oschema.clone(), obatches.clone());
        tasks.push(tokio::spawn(async move {
            let rows: u64 = batches.iter().map(|b| b.num_rows() as u64).sum();
            let mut n = 0u64;
            while Instant::now() < until {
                let name = format!("w{w}_{n}");
                let put = client
                    .put(
                        &name,
                        "0",
                        schema.clone(),
                        futures::stream::iter(batches.clone().into_iter().map(Ok)),
                    )
                    .await;
                match put {
                    Ok(s) => {
                        assert_eq!(s.rows, rows, "{name}: the node says it stored other rows");
                        figures.lock().expect("figures").puts += 1;
                        stored.lock().expect("stored").insert(name, rows);
                        n += 1;
                    }
                    Err(e) if refused(&e) => {
                        figures.lock().expect("figures").puts_refused += 1;
                        let hint = match &e {
                            csd_runtime::node_client::Error::Busy { retry_after, .. } => {
                                *retry_after
                            }
                            _ => Duration::from_secs(1),
                        };
                        tokio::time::sleep(hint).await;
                        continue;
                    }
                    Err(e) => {
                        figures
                            .lock()
                            .expect("figures")
                            .puts_failed
                            .push(format!("{name}: {e}"));
                        n += 1;
                        continue;
                    }
                }
                // Every other table stored is deleted again, the oldest first.
                if n.is_multiple_of(2) {
                    let old = format!("w{w}_{}", n - 2);
                    if client.delete(&old, None).await.is_ok() {
                        stored.lock().expect("stored").remove(&old);
                        deleted.lock().expect("deleted").push(old);
                        figures.lock().expect("figures").deletes += 1;
                    }
                }
            }
        }));
    }
    for _ in 0..args.scanners {
        let (client, figures) = (client.clone(), figures.clone());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < until {
                let rows = async {
                    let s = client.scan("lineitem", None, &[]).await?;
                    let batches: Vec<_> = s.try_collect().await?;
                    Ok::<u64, csd_runtime::node_client::Error>(
                        batches.iter().map(|b| b.num_rows() as u64).sum(),
                    )
                }
                .await;
                let mut f = figures.lock().expect("figures");
                match rows {
                    Ok(n) => {
                        f.scans += 1;
                        if n != lineitem_rows {
                            f.scans_wrong += 1;
                        }
                    }
                    Err(e) if refused(&e) => f.scans_refused += 1,
                    Err(e) => f.scans_failed.push(e.to_string()),
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    let peak_rss = rss.stop().await;
    let hwm = node
        .pid()
        .and_then(|pid| csd_benches::proc_status_bytes(pid, "VmHWM:"));

    // SIGKILL, restart on the same device, and check what writers were told.
    node.kill();
    let url = node.restart(&args, dir.path()).await;
    let client = NodeClient::connect(&url).await.expect("reconnect");
    let tables: BTreeMap<String, u64> = client
        .list_tables("w")
        .await
        .expect("list")
        .into_iter()
        .map(|t| (t.name, t.rows))
        .collect();
    let mut f = Arc::try_unwrap(figures)
        .expect("tasks done")
        .into_inner()
        .expect("figures");
    f.peak_rss_bytes = peak_rss;
    f.peak_hwm_bytes = hwm;
    for (name, rows) in stored.lock().expect("stored").iter() {
        match tables.get(name) {
            Some(r) if r == rows => f.survived += 1,
            Some(r) => f.lost.push(format!("{name}: {r} rows of {rows}")),
            None => f.lost.push(format!("{name}: missing")),
        }
    }
    for name in deleted.lock().expect("deleted").iter() {
        if tables.contains_key(name) {
            f.lost
                .push(format!("{name}: deleted, but back after the restart"));
        }
    }
    node.kill();

    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let peak = f.peak_rss_bytes.max(f.peak_hwm_bytes.unwrap_or(0));
    println!(
        "node --memory {} --cpus {}{}; TPC-H SF {}; {} s of {} query clients, {} writers, {} scanners",
        args.memory,
        args.cpus,
        match args.guest {
            Some(Arch::Aarch64) => " in an arm64 guest (4 x Cortex-A53, 2 GiB, TCG)",
            Some(Arch::X86_64) => " in an x86-64 guest (TCG)",
            None => "",
        },
        args.scale,
        args.secs,
        args.clients,
        args.writers,
        args.scanners
    );
    println!(
        "resident: idle {:.0} MiB, peak {:.0} MiB = {:.2}x the budget",
        mib(f.idle_rss_bytes),
        mib(peak),
        peak as f64 / f.budget_bytes as f64
    );
    println!(
        "queries: {} answered, {} wrong, {} failed ({} fragments handed back)",
        f.queries,
        f.queries_wrong,
        f.queries_failed.len(),
        f.fragments_pushed_back
    );
    println!(
        "puts: {} stored, {} refused for memory and retried, {} failed; {} deletes",
        f.puts,
        f.puts_refused,
        f.puts_failed.len(),
        f.deletes
    );
    println!(
        "scans: {} whole lineitem, {} wrong, {} refused, {} failed",
        f.scans,
        f.scans_wrong,
        f.scans_refused,
        f.scans_failed.len()
    );
    println!(
        "after kill -9: {} acknowledged tables there, {} lost",
        f.survived,
        f.lost.len()
    );
    for e in f
        .queries_failed
        .iter()
        .chain(&f.puts_failed)
        .chain(&f.scans_failed)
        .chain(&f.lost)
        .take(20)
    {
        println!("  {e}");
    }
    let path = args
        .json
        .clone()
        .unwrap_or_else(|| default_json_path("mixed"));
    write_json(&path, &f).expect("write json");
    let bad = f.queries_wrong + f.scans_wrong + f.lost.len() as u64 + f.queries_failed.len() as u64;
    if bad > 0 {
        std::process::exit(1);
    }
}
