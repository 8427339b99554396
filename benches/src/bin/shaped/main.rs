//! Where users stand: the storage node in its own network namespace behind a
//! veth pair shaped with `tc tbf`, every query its own `csd sql -f qNN.sql` process,
//! side by side with DuckDB + httpfs reading the same Parquet files from nginx in the
//! same namespace over the same link. Per rate (default 100 Mbit/s, 1 Gbit/s and
//! unshaped) and per layout (`--layouts`: files per table and nodes, every file its
//! own partition): the median of `--runs` runs per query, time, bytes counted on the
//! veth, and the answers of every system and layout checked against each other. Then
//! 4 clients at once on each layout. The workload (`--workload`) is TPC-H as
//! generated, TPC-H shuffled (rows in random order, plain strings) or `groups`
//! (keys of 10 to 10^7 values: work that does not shrink at a node).
//!
//! Needs root (namespaces, veth, tc) and `scripts/setup-shaped-bench.sh` (nginx, a
//! Python venv with DuckDB; the bench runs it). Build first:
//! `cargo build --release -p csd-client -p csd-benches && target/release/shaped`

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use csd_benches::{csd_binary, default_json_path, median, scratch_dir, write_json};

mod adbc;
mod answers;
mod figures;
mod groups;
mod layout;
mod pipelines;
mod serving;
mod workload;

use answers::same_answer;
use csd_benches::net::{Net, sh, start_nodes, stop_nodes};
use figures::{
    ConcurrentFigures, QueryFigures, Report, Run, SystemFigures, print_report, run_process,
};
use layout::Layout;
use pipelines::run_pipelines;
use serving::{TOKEN, start_nginx, write_security};
use workload::Workload;

#[derive(Parser)]
struct Args {
    /// What runs: `tpch`, `tpch-shuffled` (rows in random order across each table's
    /// files, plain strings) or `groups` (keys of 10 to 10^7 values; 17 queries).
    #[arg(long, default_value = "tpch")]
    workload: Workload,
    /// Scale: TPC-H's scale factor; for `groups`, `facts` has 10M rows × scale.
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Link rates in Mbit/s; 0 = the veth unshaped.
    #[arg(long, value_delimiter = ',', default_value = "100,1000,0")]
    rates: Vec<f64>,
    /// Runs per query and system (the median counts).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Queries (default: all of the workload's).
    #[arg(long, value_delimiter = ',')]
    queries: Vec<u32>,
    /// Systems: duckdb, adaptive, always, never (node policies), no-pushdown,
    /// secure / secure-no-pushdown (adaptive with TLS and a tenant's token), and
    /// adbc (adaptive through `csd gateway`, ADBC's DBAPI on one connection, plus
    /// `SELECT * FROM orders` against a direct DoGet; not in the concurrent part).
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
    /// Layouts, `FILESxNODES` each: every table (but the small ones) in FILES
    /// Parquet files, each stored as its own partition, spread over NODES nodes
    /// (`FILESxW1:W2…`: unevenly, node j holding files in proportion to Wj;
    /// `FILESxNODESrCOPIES`: each file on COPIES nodes, by `csd put --replicas`).
    #[arg(long, value_delimiter = ',', default_value = "1x1,4x1,16x1,16x4")]
    layouts: Vec<Layout>,
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

const SYSTEMS: [&str; 8] = [
    "adbc",
    "duckdb",
    "adaptive",
    "always",
    "never",
    "no-pushdown",
    "secure",
    "secure-no-pushdown",
];

/// Runs `f` with the nodes of `devices` up with `system`'s policy (csd systems),
/// stopped afterwards.
fn with_node<T>(
    net: &mut Net,
    ctx: &mut Ctx,
    devices: &[PathBuf],
    system: &str,
    args: &Args,
    f: impl FnOnce(&Ctx, &Net) -> T,
) -> T {
    let policy = match system {
        "adaptive" | "always" | "never" => Some(system),
        "no-pushdown" | "secure" | "secure-no-pushdown" | "adbc" => Some("adaptive"),
        _ => None,
    };
    if let Some(policy) = policy {
        let mut extra = args.serve_args.clone();
        if system.starts_with("secure") {
            let d = ctx.security.display();
            extra +=
                &format!(" --auth {d}/tenants.toml --tls-cert {d}/node.pem --tls-key {d}/node.key");
        }
        ctx.nodes = start_nodes(net, devices, false, policy, &extra);
    }
    let out = f(ctx, net);
    if policy.is_some() {
        stop_nodes(net, devices.len());
    }
    out
}

#[derive(Clone)]
struct Ctx {
    workload: Workload,
    python: PathBuf,
    script: PathBuf,
    queries_dir: PathBuf,
    /// The layout's files over HTTP and on local disk, and how many per table.
    http: String,
    local: PathBuf,
    files: usize,
    nodes: Vec<String>,
    /// Certificates and the tenants file of `secure` nodes.
    security: PathBuf,
}

fn command(ctx: &Ctx, system: &str, q: u32) -> Command {
    let file = ctx.queries_dir.join(format!("q{q}.sql"));
    match system {
        "duckdb" | "duckdb-local" => {
            let mut c = Command::new(&ctx.python);
            c.arg(&ctx.script)
                .args(["--files", &ctx.files.to_string()])
                .args(["--tables", &ctx.workload.tables().join(",")])
                .arg("--data");
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
            c.arg("sql");
            for n in &ctx.nodes {
                c.args(["--node", n]);
            }
            c.args(["--format", "csv", "-f"]).arg(&file);
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

fn run_system(
    ctx: &Ctx,
    net: &Net,
    system: &str,
    rate: f64,
    layout: Layout,
    args: &Args,
) -> SystemFigures {
    let mut queries = Vec::new();
    let mut adbc = (system == "adbc").then(|| adbc::Adbc::start(ctx));
    for &q in &query_list(args) {
        let runs: Vec<Run> = (0..args.runs)
            .map(|_| match &mut adbc {
                Some(client) => client.run(&ctx.queries_dir.join(format!("q{q}.sql")), net),
                None => run_process(command(ctx, system, q), net),
            })
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
            query_ms: med(&|r| r.query_ms),
            handed_back: med(&|r| r.handed_back.map(|h| h as f64)),
            runs,
        };
        eprintln!(
            "  {layout:<5} {system:<12} {rate:>6} Mbit/s q{q:<2} {:>7.3} s {:>9.2} MB{}",
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
        layout: layout.to_string(),
        rate_mbit: rate,
        total_secs: queries.iter().map(|q| q.secs).sum(),
        total_bytes: queries.iter().map(|q| q.bytes).sum(),
        total_inner_ms: (total_inner.len() == queries.len()).then(|| total_inner.iter().sum()),
        total_query_ms: queries.iter().map(|q| q.query_ms).sum::<Option<f64>>(),
        queries,
    }
}

fn query_list(args: &Args) -> Vec<u32> {
    if args.queries.is_empty() {
        args.workload.queries()
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

/// `SELECT * FROM orders` through ADBC against a direct `DoGet`, medians of
/// `--runs`.
fn large_result(
    ctx: &Ctx,
    net: &Net,
    rate: f64,
    layout: Layout,
    args: &Args,
) -> adbc::LargeFigures {
    let mut client = adbc::Adbc::start(ctx);
    let runs: Vec<_> = (0..args.runs)
        .map(|_| client.large("orders", ctx, net))
        .collect();
    let med = |i: usize, f: &dyn Fn(&(f64, u64)) -> f64| {
        median(runs.iter().map(|r| f(&r.1[i])).collect())
    };
    let figures = adbc::LargeFigures {
        table: "orders".into(),
        layout: layout.to_string(),
        rate_mbit: rate,
        rows: runs[0].0,
        adbc_secs: med(0, &|r| r.0),
        doget_secs: med(1, &|r| r.0),
        adbc_bytes: med(0, &|r| r.1 as f64) as u64,
        doget_bytes: med(1, &|r| r.1 as f64) as u64,
    };
    eprintln!(
        "  {layout} SELECT * FROM orders: ADBC {:.2} s, DoGet {:.2} s",
        figures.adbc_secs, figures.doget_secs
    );
    figures
}

/// Achieved Mbit/s of one HTTP GET of the workload's largest table (one file)
/// through the link.
fn measure_link(ctx: &Ctx, http: &str) -> f64 {
    let table = ctx.workload.tables().last().expect("a table");
    let out = sh(Command::new(&ctx.python).args([
        "-c",
        &format!(
            "import urllib.request,time\nt=time.perf_counter()\nn=len(urllib.request.urlopen('{http}/{table}.parquet').read())\nprint(n*8/1e6/(time.perf_counter()-t))",
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
    // Written once and kept for later runs: under --dir when given (nginx serves it,
    // so it must be readable by nginx's user: not under /root), else the target dir.
    let data = args.dir.as_ref().unwrap_or(&target).join("shaped-data");
    let mut layouts = args.layouts.clone();
    layouts.dedup();
    let mut files: Vec<usize> = layouts.iter().map(|l| l.files).chain([1]).collect();
    files.sort_unstable();
    files.dedup();
    let w = args.workload;
    for &f in &files {
        let dir = w.data_dir(&data, args.scale, f);
        eprintln!(
            "writing {} as Parquet, {f} file(s) per table, in {}",
            w.describe(args.scale),
            dir.display()
        );
        w.write_tables(args.scale, f, &dir);
    }

    let work = scratch_dir(args.dir.clone()).expect("scratch dir");
    let mut net = Net::create();
    let http_root = start_nginx(&mut net, &data, work.path());
    let http_of = |f: usize| {
        let dir = w.data_dir(Path::new(""), args.scale, f);
        format!("{http_root}/{}", dir.display())
    };
    let security = work.path().join("security");
    write_security(&security);
    let mut ctx = Ctx {
        workload: w,
        security,
        python: venv.join("bin/python"),
        script: root.join("benches/duckdb_query.py"),
        queries_dir: w.queries_dir(&root),
        http: http_of(1),
        local: w.data_dir(&data, args.scale, 1),
        files: 1,
        nodes: Vec::new(),
    };
    eprintln!("loading the tables into the nodes with csd put");
    let devices: Vec<(Layout, Vec<PathBuf>)> = layouts
        .iter()
        .map(|&l| {
            let dir = w.data_dir(&data, args.scale, l.files);
            (
                l,
                layout::load(&mut net, w, l, &dir, work.path(), &args.serve_args),
            )
        })
        .collect();
    let set_layout = |ctx: &mut Ctx, l: Layout| {
        ctx.files = l.files;
        ctx.http = http_of(l.files);
        ctx.local = w.data_dir(&data, args.scale, l.files);
    };

    if args.pipeline {
        let (l, devices) = &devices[0];
        set_layout(&mut ctx, *l);
        run_pipelines(&mut net, &mut ctx, devices, work.path(), &args);
        return;
    }
    let mut report = Report {
        workload: w.describe(args.scale),
        scale: args.scale,
        runs: args.runs,
        measured_mbit: BTreeMap::new(),
        sequential: Vec::new(),
        concurrent: Vec::new(),
        large: Vec::new(),
        mismatches: Vec::new(),
    };
    if !args.no_local {
        for (l, _) in &devices {
            eprintln!("DuckDB on the local files of layout {l}, 2 threads (the engine reference)");
            set_layout(&mut ctx, *l);
            report
                .sequential
                .push(run_system(&ctx, &net, "duckdb-local", -1.0, *l, &args));
        }
    }
    for &rate in &args.rates {
        net.shape(rate);
        let got = measure_link(&ctx, &http_of(1));
        eprintln!("link {rate} Mbit/s: an HTTP GET achieved {got:.0} Mbit/s");
        report.measured_mbit.insert(format!("{rate}"), got);
        for (l, devs) in &devices {
            set_layout(&mut ctx, *l);
            for system in &args.systems {
                let (figures, large) =
                    with_node(&mut net, &mut ctx, devs, system, &args, |ctx, net| {
                        let figures = run_system(ctx, net, system, rate, *l, &args);
                        let large =
                            (system == "adbc").then(|| large_result(ctx, net, rate, *l, &args));
                        (figures, large)
                    });
                report.sequential.push(figures);
                report.large.extend(large);
            }
        }
    }
    if args.clients > 0 {
        net.shape(args.concurrent_rate);
        for (l, devs) in &devices {
            set_layout(&mut ctx, *l);
            for system in args.systems.iter().filter(|s| *s != "adbc") {
                let walls: Vec<(f64, u64)> =
                    with_node(&mut net, &mut ctx, devs, system, &args, |ctx, net| {
                        (0..args.concurrent_runs.max(1))
                            .map(|_| run_concurrent(ctx, net, system, args.clients, &args))
                            .collect()
                    });
                let fig = ConcurrentFigures {
                    system: system.clone(),
                    layout: l.to_string(),
                    rate_mbit: args.concurrent_rate,
                    clients: args.clients,
                    wall_secs: median(walls.iter().map(|w| w.0).collect()),
                    bytes: median(walls.iter().map(|w| w.1 as f64).collect()) as u64,
                };
                eprintln!(
                    "  {l} {} clients, {system}: {:.2} s, {:.1} MB",
                    args.clients,
                    fig.wall_secs,
                    fig.bytes as f64 / 1e6
                );
                report.concurrent.push(fig);
            }
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
                                "q{q}: {} on layout {} at {} Mbit/s differs from {name}",
                                s.system, s.layout, s.rate_mbit
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
