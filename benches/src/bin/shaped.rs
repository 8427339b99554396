//! TPC-H where users stand: the storage node in its own network namespace behind a
//! veth pair shaped with `tc tbf`, every query its own `csd sql -f qNN.sql` process,
//! side by side with DuckDB + httpfs reading the same Parquet files from nginx in the
//! same namespace over the same link. Per rate (default 100 Mbit/s, 1 Gbit/s and
//! unshaped): the median of `--runs` runs per query, time, bytes counted on the veth,
//! and the answers of every system checked against each other. Then 4 clients at once.
//!
//! Needs root (namespaces, veth, tc) and `scripts/setup-shaped-bench.sh` (nginx, a
//! Python venv with DuckDB; the bench runs it). Build first:
//! `cargo build --release -p csd-client -p csd-benches && target/release/shaped`

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use csd_benches::pipeline_steps::{STEP1, step2, step3};
use csd_benches::{csd_binary, default_json_path, scratch_dir, write_json};
use csd_testbed::tpch;
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::parquet::basic::Compression;
use datafusion::parquet::file::properties::WriterProperties;
use serde::Serialize;

#[derive(Parser)]
struct Args {
    /// TPC-H scale factor.
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Link rates in Mbit/s; 0 = the veth unshaped.
    #[arg(long, value_delimiter = ',', default_value = "100,1000,0")]
    rates: Vec<f64>,
    /// Runs per query and system (the median counts).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Queries (default: all 22).
    #[arg(long, value_delimiter = ',')]
    queries: Vec<u32>,
    /// Systems: duckdb, adaptive, always, never (node policies), no-pushdown, and
    /// secure / secure-no-pushdown (adaptive with TLS and a tenant's token).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "duckdb,adaptive,always,never,no-pushdown"
    )]
    systems: Vec<String>,
    /// Clients at once in the concurrent part (0 = skip it).
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Runs of the concurrent part (the median counts).
    #[arg(long, default_value_t = 1)]
    concurrent_runs: usize,
    /// Link rate of the concurrent part, Mbit/s.
    #[arg(long, default_value_t = 1000.0)]
    concurrent_rate: f64,
    /// Skip DuckDB on local files (the engine reference).
    #[arg(long)]
    no_local: bool,
    /// Extra `csd serve` arguments (space-separated).
    #[arg(long, default_value = "")]
    serve_args: String,
    /// Python venv with DuckDB (made by scripts/setup-shaped-bench.sh).
    #[arg(long)]
    venv: Option<PathBuf>,
    /// Directory for data and the device file.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// JSON output path.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Instead of the TPC-H queries: a three-step pipeline over lineitem as `csd`
    /// processes, each step kept at the node (`csd sql --keep`, the next step
    /// reading `csd_ref_…`) vs each step's answer brought back as CSV and stored
    /// again (`csd sql > step.csv; csd put step.csv`).
    #[arg(long)]
    pipeline: bool,
}

const NODE_IP: &str = "10.231.7.2";
const HOST_IP: &str = "10.231.7.1";

fn sh(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn ip(args: &[&str]) -> String {
    sh(Command::new("ip").args(args))
}

/// The namespace, the veth pair and the servers in it; all removed on drop.
struct Net {
    ns: String,
    host_dev: String,
    peer_dev: String,
    children: Vec<Child>,
}

impl Net {
    fn new() -> Net {
        let id = std::process::id() % 100_000;
        let net = Net {
            ns: format!("csd-shaped-{id}"),
            host_dev: format!("csdh{id}"),
            peer_dev: format!("csdn{id}"),
            children: Vec::new(),
        };
        ip(&["netns", "add", &net.ns]);
        ip(&[
            "link",
            "add",
            &net.host_dev,
            "type",
            "veth",
            "peer",
            "name",
            &net.peer_dev,
        ]);
        ip(&["link", "set", &net.peer_dev, "netns", &net.ns]);
        ip(&[
            "addr",
            "add",
            &format!("{HOST_IP}/24"),
            "dev",
            &net.host_dev,
        ]);
        ip(&["link", "set", &net.host_dev, "up"]);
        net.exec(&[
            "ip",
            "addr",
            "add",
            &format!("{NODE_IP}/24"),
            "dev",
            &net.peer_dev,
        ]);
        net.exec(&["ip", "link", "set", &net.peer_dev, "up"]);
        net.exec(&["ip", "link", "set", "lo", "up"]);
        net
    }

    fn in_ns(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns, program]);
        c
    }

    fn exec(&self, args: &[&str]) -> String {
        sh(self.in_ns(args[0]).args(&args[1..]))
    }

    /// `tbf` at `mbit` on both ends (0: remove the shaping).
    fn shape(&self, mbit: f64) {
        let _ = Command::new("tc")
            .args(["qdisc", "del", "dev", &self.host_dev, "root"])
            .stderr(Stdio::null())
            .status();
        let _ = self
            .in_ns("tc")
            .args(["qdisc", "del", "dev", &self.peer_dev, "root"])
            .stderr(Stdio::null())
            .status();
        if mbit <= 0.0 {
            return;
        }
        let rate = format!("{}kbit", (mbit * 1000.0) as u64);
        // A burst of 10 ms of the rate (at least 64 KiB, the largest GSO packet).
        let burst = format!("{}", ((mbit * 1e6 / 8.0 / 100.0) as u64).max(65536));
        let tbf = [
            "root", "tbf", "rate", &rate, "burst", &burst, "latency", "50ms",
        ];
        sh(Command::new("tc")
            .args(["qdisc", "add", "dev", &self.host_dev])
            .args(tbf));
        sh(self
            .in_ns("tc")
            .args(["qdisc", "add", "dev", &self.peer_dev])
            .args(tbf));
    }

    /// Bytes both ways on the veth so far.
    fn bytes(&self) -> u64 {
        ["rx_bytes", "tx_bytes"]
            .iter()
            .map(|f| {
                std::fs::read_to_string(format!("/sys/class/net/{}/statistics/{f}", self.host_dev))
                    .ok()
                    .and_then(|s| s.trim().parse::<u64>().ok())
                    .unwrap_or(0)
            })
            .sum()
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // SIGTERM first: nginx's master then stops its workers (a SIGKILLed master
        // leaves them running, holding the namespace and this process's stdout).
        for c in &self.children {
            // SAFETY: kill has no memory preconditions; the pid is our own child's.
            unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGTERM) };
        }
        for c in &mut self.children {
            let deadline = Instant::now() + Duration::from_secs(3);
            while matches!(c.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_dev])
            .stderr(Stdio::null())
            .status();
    }
}

/// Writes each TPC-H table as one Parquet file (Snappy, 122,880-row groups: what
/// DuckDB's own `COPY … (FORMAT parquet)` writes).
fn write_tables(scale: f64, dir: &Path) {
    std::fs::create_dir_all(dir).expect("data dir");
    for table in tpch::TABLES {
        let path = dir.join(format!("{table}.parquet"));
        if path.exists() {
            continue;
        }
        let (schema, batches) = tpch::generate(table, scale, 1, 1).expect("generate");
        let props = WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .set_max_row_group_row_count(Some(122_880))
            .build();
        let tmp = path.with_extension("tmp");
        let mut w = ArrowWriter::try_new(
            std::fs::File::create(&tmp).expect("create"),
            schema,
            Some(props),
        )
        .expect("writer");
        for b in &batches {
            w.write(b).expect("write");
        }
        w.close().expect("close");
        std::fs::rename(&tmp, &path).expect("rename");
    }
}

fn start_nginx(net: &mut Net, data: &Path, work: &Path) -> String {
    let conf = work.join("nginx.conf");
    let w = work.display();
    std::fs::write(
        &conf,
        format!(
            "worker_processes 2;\npid {w}/nginx.pid;\nerror_log {w}/nginx.err;\nevents {{}}\n\
             http {{\n  access_log off;\n  sendfile on;\n  client_body_temp_path {w};\n  proxy_temp_path {w};\n  fastcgi_temp_path {w};\n  uwsgi_temp_path {w};\n  scgi_temp_path {w};\n  server {{\n    listen {NODE_IP}:8080;\n    root {};\n  }}\n}}\n",
            data.display()
        ),
    )
    .expect("nginx.conf");
    let child = net
        .in_ns("nginx")
        .args(["-c"])
        .arg(&conf)
        .args(["-g", "daemon off;"])
        .stderr(Stdio::null())
        .spawn()
        .expect("nginx (scripts/setup-shaped-bench.sh installs it)");
    net.children.push(child);
    std::thread::sleep(Duration::from_millis(300));
    format!("http://{NODE_IP}:8080")
}

/// Starts `csd serve` in the namespace with `policy`; returns its index in children.
fn start_node(net: &mut Net, device: &Path, format: bool, policy: &str, extra: &str) -> String {
    let mut cmd = net.in_ns(csd_binary().to_str().expect("utf-8 path"));
    cmd.args(["serve", "--listen", &format!("{NODE_IP}:50051")])
        .arg("--device")
        .arg(device)
        .args(["--capacity", "8GiB", "--policy", policy])
        .args(extra.split_whitespace())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped());
    if format {
        cmd.arg("--format");
    }
    let mut child = cmd.spawn().expect("csd serve");
    let url = csd_benches::node_url(&mut child);
    net.children.push(child);
    url.replace("0.0.0.0", NODE_IP)
}

const SYSTEMS: [&str; 7] = [
    "duckdb",
    "adaptive",
    "always",
    "never",
    "no-pushdown",
    "secure",
    "secure-no-pushdown",
];

/// The token of the bench's tenant on `secure` nodes.
const TOKEN: &str = "shaped-bench-token";

/// Certificates for the node's address and a tenants file, in `dir`.
fn write_security(dir: &Path) {
    let certs =
        csd_runtime::tls::make_certificates(&[NODE_IP.to_string()], "bench").expect("certificates");
    certs.write(dir).expect("writing certificates");
    std::fs::write(
        dir.join("tenants.toml"),
        format!(
            "[[tenant]]\nname = \"bench\"\ntoken_sha256 = \"{}\"\ntables = [\"*\"]\ncan = [\"read\"]\n",
            csd_runtime::auth::token_digest(TOKEN)
        ),
    )
    .expect("tenants file");
}

/// Runs `f` with a node of `system`'s policy up (csd systems), stopped afterwards.
fn with_node<T>(
    net: &mut Net,
    ctx: &mut Ctx,
    device: &Path,
    system: &str,
    args: &Args,
    f: impl FnOnce(&Ctx, &Net) -> T,
) -> T {
    let policy = match system {
        "adaptive" | "always" | "never" => Some(system),
        "no-pushdown" | "secure" | "secure-no-pushdown" => Some("adaptive"),
        _ => None,
    };
    if let Some(policy) = policy {
        let mut extra = args.serve_args.clone();
        if system.starts_with("secure") {
            let d = ctx.security.display();
            extra +=
                &format!(" --auth {d}/tenants.toml --tls-cert {d}/node.pem --tls-key {d}/node.key");
        }
        ctx.node = start_node(net, device, false, policy, &extra);
    }
    let out = f(ctx, net);
    if policy.is_some() {
        stop_node(net);
    }
    out
}

fn stop_node(net: &mut Net) {
    if let Some(mut c) = net.children.pop() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// One finished query process.
#[derive(Debug, Clone, Serialize)]
struct Run {
    secs: f64,
    bytes: u64,
    /// The query time the process reported (DuckDB: after loading; csd: the node's
    /// run time summed over fragments, less queueing).
    inner_ms: Option<f64>,
    handed_back: Option<u64>,
    #[serde(skip)]
    stdout: String,
}

fn parse_after(s: &str, key: &str) -> Option<f64> {
    let i = s.find(key)?;
    let before = s[..i].trim_end();
    before.rsplit(' ').next()?.parse().ok()
}

fn run_process(mut cmd: Command, net: &Net) -> Run {
    let before = net.bytes();
    let started = Instant::now();
    let out = cmd.output().expect("query process");
    let secs = started.elapsed().as_secs_f64();
    let bytes = net.bytes() - before;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{cmd:?} failed: {stderr}");
    let inner_ms = parse_after(&stderr, "ms run at the nodes").or_else(|| {
        stderr
            .lines()
            .find(|l| l.starts_with("duckdb:"))
            .and_then(|l| parse_after(l, "ms"))
    });
    let handed_back = parse_after(&stderr, "handed back").map(|h| h as u64);
    Run {
        secs,
        bytes,
        inner_ms,
        handed_back,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
    }
}

#[derive(Clone)]
struct Ctx {
    python: PathBuf,
    script: PathBuf,
    queries_dir: PathBuf,
    http: String,
    local: PathBuf,
    node: String,
    /// Certificates and the tenants file of `secure` nodes.
    security: PathBuf,
}

fn command(ctx: &Ctx, system: &str, q: u32) -> Command {
    let file = ctx.queries_dir.join(format!("q{q}.sql"));
    match system {
        "duckdb" | "duckdb-local" => {
            let mut c = Command::new(&ctx.python);
            c.arg(&ctx.script).arg("--data");
            if system == "duckdb" {
                c.arg(&ctx.http);
            } else {
                c.arg(&ctx.local).args(["--threads", "2"]);
            }
            c.arg(&file);
            c
        }
        _ => {
            let mut c = Command::new(csd_binary());
            c.args(["sql", "--node", &ctx.node, "--format", "csv", "-f"])
                .arg(&file);
            if system.ends_with("no-pushdown") {
                c.arg("--no-pushdown");
            }
            if system.starts_with("secure") {
                c.arg("--tls-ca")
                    .arg(ctx.security.join("ca.pem"))
                    .env("CSD_TOKEN", TOKEN);
            }
            c
        }
    }
}

/// CSV rows as fields (quotes honoured); the header is dropped.
fn rows(csv: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for line in csv.lines().skip(1) {
        let mut fields = Vec::new();
        let mut cur = String::new();
        let mut quoted = false;
        let mut chars = line.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '"' if quoted && chars.peek() == Some(&'"') => {
                    cur.push('"');
                    chars.next();
                }
                '"' => quoted = !quoted,
                ',' if !quoted => fields.push(std::mem::take(&mut cur)),
                c => cur.push(c),
            }
        }
        fields.push(cur);
        out.push(fields);
    }
    out
}

fn same_value(a: &str, b: &str) -> bool {
    if a == b {
        return true;
    }
    match (a.parse::<f64>(), b.parse::<f64>()) {
        (Ok(x), Ok(y)) => (x - y).abs() <= 1e-6 * x.abs().max(y.abs()).max(1.0),
        _ => a.trim() == b.trim(),
    }
}

fn same_rows(a: &[Vec<String>], b: &[Vec<String>]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.len() == y.len() && x.iter().zip(y).all(|(u, v)| same_value(u, v)))
}

/// Equal in order, or (ties under ORDER BY) equal as sorted multisets.
fn same_answer(a: &str, b: &str) -> bool {
    let (mut x, mut y) = (rows(a), rows(b));
    if same_rows(&x, &y) {
        return true;
    }
    x.sort();
    y.sort();
    same_rows(&x, &y)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return 0.0;
    }
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[derive(Serialize, Clone)]
struct QueryFigures {
    query: u32,
    secs: f64,
    bytes: f64,
    inner_ms: Option<f64>,
    handed_back: Option<f64>,
    runs: Vec<Run>,
}

#[derive(Serialize, Clone)]
struct SystemFigures {
    system: String,
    rate_mbit: f64,
    total_secs: f64,
    total_bytes: f64,
    total_inner_ms: Option<f64>,
    queries: Vec<QueryFigures>,
}

#[derive(Serialize)]
struct Report {
    scale: f64,
    runs: usize,
    measured_mbit: BTreeMap<String, f64>,
    sequential: Vec<SystemFigures>,
    concurrent: Vec<ConcurrentFigures>,
    mismatches: Vec<String>,
}

#[derive(Serialize)]
struct ConcurrentFigures {
    system: String,
    rate_mbit: f64,
    clients: usize,
    wall_secs: f64,
    bytes: u64,
}

fn run_system(ctx: &Ctx, net: &Net, system: &str, rate: f64, args: &Args) -> SystemFigures {
    let mut queries = Vec::new();
    for &q in &query_list(args) {
        let runs: Vec<Run> = (0..args.runs)
            .map(|_| run_process(command(ctx, system, q), net))
            .collect();
        let med = |f: &dyn Fn(&Run) -> Option<f64>| {
            let v: Vec<f64> = runs.iter().filter_map(f).collect();
            (!v.is_empty()).then(|| median(v))
        };
        let fig = QueryFigures {
            query: q,
            secs: median(runs.iter().map(|r| r.secs).collect()),
            bytes: median(runs.iter().map(|r| r.bytes as f64).collect()),
            inner_ms: med(&|r| r.inner_ms),
            handed_back: med(&|r| r.handed_back.map(|h| h as f64)),
            runs,
        };
        eprintln!(
            "  {system:<12} {rate:>6} Mbit/s q{q:<2} {:>7.3} s {:>9.2} MB{}",
            fig.secs,
            fig.bytes / 1e6,
            fig.handed_back
                .filter(|h| *h > 0.0)
                .map(|h| format!(" ({h} handed back)"))
                .unwrap_or_default()
        );
        queries.push(fig);
    }
    let total_inner: Vec<f64> = queries.iter().filter_map(|q| q.inner_ms).collect();
    SystemFigures {
        system: system.to_string(),
        rate_mbit: rate,
        total_secs: queries.iter().map(|q| q.secs).sum(),
        total_bytes: queries.iter().map(|q| q.bytes).sum(),
        total_inner_ms: (total_inner.len() == queries.len()).then(|| total_inner.iter().sum()),
        queries,
    }
}

fn query_list(args: &Args) -> Vec<u32> {
    if args.queries.is_empty() {
        (1..=22).collect()
    } else {
        args.queries.clone()
    }
}

/// `clients` processes' worth of the query list at once, each starting elsewhere.
fn run_concurrent(ctx: &Ctx, net: &Net, system: &str, clients: usize, args: &Args) -> (f64, u64) {
    let qs = Arc::new(query_list(args));
    let before = net.bytes();
    let started = Instant::now();
    let handles: Vec<_> = (0..clients)
        .map(|c| {
            let (ctx, qs, system) = (ctx.clone(), qs.clone(), system.to_string());
            std::thread::spawn(move || {
                let n = qs.len();
                for i in 0..n {
                    let q = qs[(i + c * n / clients.max(1)) % n];
                    let out = command(&ctx, &system, q).output().expect("query");
                    assert!(
                        out.status.success(),
                        "{system} q{q}: {}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("client thread");
    }
    (started.elapsed().as_secs_f64(), net.bytes() - before)
}

/// Achieved Mbit/s of one HTTP GET of lineitem through the link.
fn measure_link(ctx: &Ctx) -> f64 {
    let out = sh(Command::new(&ctx.python).args([
        "-c",
        &format!(
            "import urllib.request,time\nt=time.perf_counter()\nn=len(urllib.request.urlopen('{}/lineitem.parquet').read())\nprint(n*8/1e6/(time.perf_counter()-t))",
            ctx.http
        ),
    ]));
    out.trim().parse().unwrap_or(0.0)
}

fn main() {
    let args = Args::parse();
    if let Some(bad) = args.systems.iter().find(|s| !SYSTEMS.contains(&s.as_str())) {
        eprintln!(
            "shaped: unknown system {bad:?} (one of {})",
            SYSTEMS.join(", ")
        );
        std::process::exit(2);
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("shaped: needs root (network namespaces, veth, tc)");
        std::process::exit(2);
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let target = PathBuf::from(
        std::env::var("CARGO_TARGET_DIR")
            .unwrap_or_else(|_| root.join("target").display().to_string()),
    );
    let venv = args
        .venv
        .clone()
        .unwrap_or_else(|| target.join("bench-venv"));
    sh(Command::new("bash")
        .arg(root.join("scripts/setup-shaped-bench.sh"))
        .arg(&venv));
    let data = target.join(format!("tpch-parquet-sf{}", args.scale));
    eprintln!(
        "writing TPC-H SF {} as Parquet in {}",
        args.scale,
        data.display()
    );
    write_tables(args.scale, &data);

    let work = scratch_dir(args.dir.clone()).expect("scratch dir");
    let mut net = Net::new();
    let http = start_nginx(&mut net, &data, work.path());
    let device = work.path().join("node.img");
    let security = work.path().join("security");
    write_security(&security);
    let mut ctx = Ctx {
        security,
        python: venv.join("bin/python"),
        script: root.join("benches/duckdb_query.py"),
        queries_dir: root.join("testbed/queries/tpch"),
        http,
        local: data.clone(),
        node: start_node(&mut net, &device, true, "adaptive", &args.serve_args),
    };
    eprintln!("loading the tables into the node with csd put");
    for table in tpch::TABLES {
        sh(Command::new(csd_binary())
            .args(["put", "--node", &ctx.node, "--table", table])
            .arg(data.join(format!("{table}.parquet"))));
    }
    stop_node(&mut net);

    if args.pipeline {
        run_pipelines(&mut net, &mut ctx, &device, work.path(), &args);
        return;
    }
    let mut report = Report {
        scale: args.scale,
        runs: args.runs,
        measured_mbit: BTreeMap::new(),
        sequential: Vec::new(),
        concurrent: Vec::new(),
        mismatches: Vec::new(),
    };
    if !args.no_local {
        eprintln!("DuckDB on the local files, 2 threads (the engine reference)");
        report
            .sequential
            .push(run_system(&ctx, &net, "duckdb-local", -1.0, &args));
    }
    for &rate in &args.rates {
        net.shape(rate);
        let got = measure_link(&ctx);
        eprintln!("link {rate} Mbit/s: an HTTP GET achieved {got:.0} Mbit/s");
        report.measured_mbit.insert(format!("{rate}"), got);
        for system in &args.systems {
            let figures = with_node(&mut net, &mut ctx, &device, system, &args, |ctx, net| {
                run_system(ctx, net, system, rate, &args)
            });
            report.sequential.push(figures);
        }
    }
    if args.clients > 0 {
        net.shape(args.concurrent_rate);
        for system in &args.systems {
            let walls: Vec<(f64, u64)> =
                with_node(&mut net, &mut ctx, &device, system, &args, |ctx, net| {
                    (0..args.concurrent_runs.max(1))
                        .map(|_| run_concurrent(ctx, net, system, args.clients, &args))
                        .collect()
                });
            let fig = ConcurrentFigures {
                system: system.clone(),
                rate_mbit: args.concurrent_rate,
                clients: args.clients,
                wall_secs: median(walls.iter().map(|w| w.0).collect()),
                bytes: median(walls.iter().map(|w| w.1 as f64).collect()) as u64,
            };
            eprintln!(
                "  {} clients, {system}: {:.2} s, {:.1} MB",
                args.clients,
                fig.wall_secs,
                fig.bytes as f64 / 1e6
            );
            report.concurrent.push(fig);
        }
    }
    drop(net);

    // Every system's answers against the first system's, query by query.
    for q in query_list(&args) {
        let mut reference: Option<(&str, &str)> = None;
        for s in &report.sequential {
            let Some(f) = s.queries.iter().find(|f| f.query == q) else {
                continue;
            };
            for r in &f.runs {
                match reference {
                    None => reference = Some((&s.system, &r.stdout)),
                    Some((name, answer)) => {
                        if !same_answer(answer, &r.stdout) {
                            report.mismatches.push(format!(
                                "q{q}: {} at {} Mbit/s differs from {name}",
                                s.system, s.rate_mbit
                            ));
                        }
                    }
                }
            }
        }
    }
    print_report(&report);
    let path = args
        .json
        .clone()
        .unwrap_or_else(|| default_json_path("shaped"));
    write_json(&path, &report).expect("json");
    if !report.mismatches.is_empty() {
        std::process::exit(1);
    }
}

fn print_report(r: &Report) {
    println!(
        "\nTPC-H SF {}, {} queries, median of {} runs per query; every query its own process",
        r.scale,
        r.sequential.first().map_or(0, |s| s.queries.len()),
        r.runs
    );
    println!(
        "{:<14} {:>10} {:>10} {:>12} {:>12} {:>12} {:>12}",
        "system", "link", "total s", "MB on veth", "vs duckdb", "fewer bytes", "engine ms"
    );
    for s in &r.sequential {
        let duck = r
            .sequential
            .iter()
            .find(|d| d.system == "duckdb" && d.rate_mbit == s.rate_mbit);
        let link = match s.rate_mbit {
            x if x < 0.0 => "local".to_string(),
            0.0 => "unshaped".to_string(),
            x => format!("{x} Mbit"),
        };
        println!(
            "{:<14} {:>10} {:>10.2} {:>12.1} {:>12} {:>12} {:>12}",
            s.system,
            link,
            s.total_secs,
            s.total_bytes / 1e6,
            duck.map(|d| format!("{:.2}x", d.total_secs / s.total_secs))
                .unwrap_or_default(),
            duck.filter(|_| s.total_bytes > 0.0)
                .map(|d| format!("{:.1}x", d.total_bytes / s.total_bytes))
                .unwrap_or_default(),
            s.total_inner_ms
                .map(|m| format!("{m:.0}"))
                .unwrap_or_default(),
        );
    }
    for c in &r.concurrent {
        println!(
            "{} clients at {} Mbit/s, {:<12} {:>8.2} s {:>10.1} MB",
            c.clients,
            c.rate_mbit,
            c.system,
            c.wall_secs,
            c.bytes as f64 / 1e6
        );
    }
    if r.mismatches.is_empty() {
        println!("answers: every system agrees on every query");
    } else {
        for m in &r.mismatches {
            println!("MISMATCH {m}");
        }
    }
}

/// `csd ARGS… --node NODE`, output checked.
fn csd_out(ctx: &Ctx, a: &[&str]) -> String {
    let out = Command::new(csd_binary())
        .args(a)
        .args(["--node", &ctx.node])
        .output()
        .expect("csd");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "csd {a:?} failed: {stderr}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The kept table a `csd sql --keep` printed.
fn kept_table(refs: &str) -> String {
    let first = refs.lines().next().expect("a reference");
    let r: serde_json::Value = serde_json::from_str(first).expect("a reference is JSON");
    r["table"].as_str().expect("its table").to_string()
}

/// One pipeline, kept: its final answer (CSV); its references are released after.
fn pipeline_kept(ctx: &Ctx, work: &Path) -> (String, PathBuf) {
    let refs1 = csd_out(ctx, &["sql", "--keep", "--ttl", "10m", STEP1]);
    let refs2 = csd_out(
        ctx,
        &["sql", "--keep", "--ttl", "10m", &step2(&kept_table(&refs1))],
    );
    let answer = csd_out(
        ctx,
        &["sql", "--format", "csv", &step3(&kept_table(&refs2))],
    );
    let refs = work.join("pipeline-refs.jsonl");
    std::fs::write(&refs, format!("{refs1}{refs2}")).expect("refs file");
    (answer, refs)
}

/// One pipeline, shipped: its final answer (CSV); tables `NAME_a`, `NAME_b` are
/// deleted after.
fn pipeline_shipped(ctx: &Ctx, work: &Path, name: &str) -> String {
    let mut input = String::from("lineitem");
    for (k, step) in [("a", STEP1.to_string()), ("b", String::new())] {
        let sql = if k == "a" { step } else { step2(&input) };
        let file = work.join(format!("{name}_{k}.csv"));
        std::fs::write(&file, csd_out(ctx, &["sql", "--format", "csv", &sql])).expect("csv");
        input = format!("{name}_{k}");
        csd_out(
            ctx,
            &["put", "--table", &input, file.to_str().expect("utf-8 path")],
        );
    }
    csd_out(ctx, &["sql", "--format", "csv", &step3(&input)])
}

#[derive(Serialize)]
struct PipelineFigures {
    rate_mbit: f64,
    kept_secs: f64,
    kept_bytes: u64,
    shipped_secs: f64,
    shipped_bytes: u64,
}

/// The pipeline mode: both pipelines at every rate, medians, answers compared.
fn run_pipelines(net: &mut Net, ctx: &mut Ctx, device: &Path, work: &Path, args: &Args) {
    println!(
        "pipeline filter -> key filter -> aggregate over lineitem SF {}, csd processes over a tc-shaped veth, median of {}",
        args.scale, args.runs
    );
    println!(
        "{:>8} {:>10} {:>12} {:>12} {:>14} {:>8} {:>8}",
        "Mbit/s", "kept s", "kept bytes", "shipped s", "shipped bytes", "speedup", "bytes"
    );
    let mut figures = Vec::new();
    let mut mismatches = 0;
    for &rate in &args.rates {
        net.shape(rate);
        let (mut ks, mut kb, mut ss, mut sb) = (vec![], vec![], vec![], vec![]);
        with_node(net, ctx, device, "adaptive", args, |ctx, net| {
            for run in 0..args.runs {
                let (b0, t) = (net.bytes(), Instant::now());
                let (kept, refs) = pipeline_kept(ctx, work);
                ks.push(t.elapsed().as_secs_f64());
                kb.push((net.bytes() - b0) as f64);
                let name = format!("pipe{run}");
                let (b0, t) = (net.bytes(), Instant::now());
                let shipped = pipeline_shipped(ctx, work, &name);
                ss.push(t.elapsed().as_secs_f64());
                sb.push((net.bytes() - b0) as f64);
                if !same_answer(&kept, &shipped) {
                    eprintln!("the two pipelines disagree at {rate} Mbit/s:\n{kept}\n{shipped}");
                    mismatches += 1;
                }
                csd_out(ctx, &["release", refs.to_str().expect("utf-8 path")]);
                for k in ["a", "b"] {
                    csd_out(ctx, &["rm", &format!("{name}_{k}")]);
                }
            }
        });
        let f = PipelineFigures {
            rate_mbit: rate,
            kept_secs: median(ks),
            kept_bytes: median(kb) as u64,
            shipped_secs: median(ss),
            shipped_bytes: median(sb) as u64,
        };
        println!(
            "{:>8} {:>10.3} {:>12} {:>12.3} {:>14} {:>7.2}x {:>7.0}x",
            rate,
            f.kept_secs,
            f.kept_bytes,
            f.shipped_secs,
            f.shipped_bytes,
            f.shipped_secs / f.kept_secs,
            f.shipped_bytes as f64 / f.kept_bytes.max(1) as f64
        );
        figures.push(f);
    }
    let path = args
        .json
        .clone()
        .unwrap_or_else(|| default_json_path("shaped-pipeline"));
    write_json(&path, &figures).expect("json");
    if mismatches > 0 {
        std::process::exit(1);
    }
}
