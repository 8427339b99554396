//! What one query process took (time, bytes on the veth, what it reported) and the
//! medians and table the bench prints and writes.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Instant;

use serde::Serialize;

use csd_benches::net::Net;

/// One finished query process.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Run {
    pub(crate) secs: f64,
    pub(crate) bytes: u64,
    /// The query time the process reported (DuckDB: after loading; csd: the node's
    /// run time summed over fragments, less queueing).
    pub(crate) inner_ms: Option<f64>,
    pub(crate) handed_back: Option<u64>,
    /// The query's own time as the client reported it (`csd sql`: "N rows in X
    /// ms", after connecting and listing tables; ADBC: execute to the last batch).
    pub(crate) query_ms: Option<f64>,
    #[serde(skip)]
    pub(crate) stdout: String,
}

pub(crate) fn parse_after(s: &str, key: &str) -> Option<f64> {
    let i = s.find(key)?;
    let before = s[..i].trim_end();
    before.rsplit(' ').next()?.parse().ok()
}

pub(crate) fn run_process(mut cmd: Command, net: &Net) -> Run {
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
    // A node's reasons for returning work, kept in the bench's log.
    for why in stderr
        .lines()
        .filter(|l| l.contains("returned its fragment:"))
    {
        eprintln!("    {why}");
    }
    let query_ms = parse_after(&stderr, "ms;");
    Run {
        secs,
        bytes,
        inner_ms,
        handed_back,
        query_ms,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
    }
}

#[derive(Serialize, Clone)]
pub(crate) struct QueryFigures {
    pub(crate) query: u32,
    pub(crate) secs: f64,
    pub(crate) bytes: f64,
    pub(crate) inner_ms: Option<f64>,
    pub(crate) handed_back: Option<f64>,
    pub(crate) query_ms: Option<f64>,
    pub(crate) runs: Vec<Run>,
}

#[derive(Serialize, Clone)]
pub(crate) struct SystemFigures {
    pub(crate) system: String,
    /// Its [`crate::layout::Layout`], `FILESxNODES`.
    pub(crate) layout: String,
    pub(crate) rate_mbit: f64,
    pub(crate) total_secs: f64,
    pub(crate) total_bytes: f64,
    pub(crate) total_inner_ms: Option<f64>,
    /// Sum of the queries' own times ([`Run::query_ms`]) where every query has one.
    pub(crate) total_query_ms: Option<f64>,
    pub(crate) queries: Vec<QueryFigures>,
}

#[derive(Serialize)]
pub(crate) struct Report {
    /// The workload and its scale, in words.
    pub(crate) workload: String,
    pub(crate) scale: f64,
    pub(crate) runs: usize,
    pub(crate) measured_mbit: BTreeMap<String, f64>,
    pub(crate) sequential: Vec<SystemFigures>,
    pub(crate) concurrent: Vec<ConcurrentFigures>,
    /// `SELECT *` of a large table through ADBC against a direct `DoGet` (system
    /// `adbc`).
    pub(crate) large: Vec<crate::adbc::LargeFigures>,
    pub(crate) mismatches: Vec<String>,
}

#[derive(Serialize)]
pub(crate) struct ConcurrentFigures {
    pub(crate) system: String,
    pub(crate) layout: String,
    pub(crate) rate_mbit: f64,
    pub(crate) clients: usize,
    pub(crate) wall_secs: f64,
    pub(crate) bytes: u64,
}

pub(crate) fn print_report(r: &Report) {
    println!(
        "\n{}, {} queries, median of {} runs per query; every query its own process; layout FILESxNODES",
        r.workload,
        r.sequential.first().map_or(0, |s| s.queries.len()),
        r.runs
    );
    println!(
        "{:<6} {:<14} {:>10} {:>10} {:>12} {:>12} {:>12} {:>12}",
        "layout",
        "system",
        "link",
        "total s",
        "MB on veth",
        "vs duckdb",
        "fewer bytes",
        "engine ms"
    );
    for s in &r.sequential {
        let duck = r.find(&s.layout, "duckdb", s.rate_mbit);
        println!(
            "{:<6} {:<14} {:>10} {:>10.2} {:>12.1} {:>12} {:>12} {:>12}",
            s.layout,
            s.system,
            link(s.rate_mbit),
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
            "{:<6} {} clients at {} Mbit/s, {:<12} {:>8.2} s {:>10.1} MB",
            c.layout,
            c.clients,
            c.rate_mbit,
            c.system,
            c.wall_secs,
            c.bytes as f64 / 1e6
        );
    }
    print_per_query(r);
    print_judgement(r);
    print_gateway(r);
    if r.mismatches.is_empty() {
        println!("answers: every system agrees on every query, on every layout");
    } else {
        for m in &r.mismatches {
            println!("MISMATCH {m}");
        }
    }
}

fn link(rate_mbit: f64) -> String {
    match rate_mbit {
        x if x < 0.0 => "local".to_string(),
        0.0 => "unshaped".to_string(),
        x => format!("{x} Mbit"),
    }
}

impl Report {
    fn find(&self, layout: &str, system: &str, rate: f64) -> Option<&SystemFigures> {
        self.sequential
            .iter()
            .find(|s| s.layout == layout && s.system == system && s.rate_mbit == rate)
    }
}

/// The gateway (ADBC on one connection, `adbc`) against `csd sql` processes on the
/// same node defaults (`adaptive`): total time (process wall and the time each
/// query reported), bytes from the nodes; the large-result rates.
fn print_gateway(r: &Report) {
    let mut lines = Vec::new();
    for g in r.sequential.iter().filter(|s| s.system == "adbc") {
        let Some(a) = r.find(&g.layout, "adaptive", g.rate_mbit) else {
            continue;
        };
        let mut line = format!(
            "{:<6} {:>10}: ADBC {:.2} s vs csd sql {:.2} s ({:+.1}%)",
            g.layout,
            link(g.rate_mbit),
            g.total_secs,
            a.total_secs,
            (g.total_secs / a.total_secs - 1.0) * 100.0
        );
        if let Some(own) = a.total_query_ms {
            line += &format!(
                "; csd sql's own query time {:.2} s ({:+.1}%)",
                own / 1e3,
                (g.total_secs / (own / 1e3) - 1.0) * 100.0
            );
        }
        line += &format!(
            "; {:.1} MB from the nodes vs {:.1} MB",
            g.total_bytes / 1e6,
            a.total_bytes / 1e6
        );
        lines.push(line);
    }
    for l in &r.large {
        lines.push(format!(
            "{:<6} {:>10}: SELECT * FROM {} ({} rows): ADBC {:.0} rows/s ({:.2} s, {:.1} MB on the veth), direct DoGet {:.0} rows/s ({:.2} s, {:.1} MB): {:.2}x",
            l.layout,
            link(l.rate_mbit),
            l.table,
            l.rows,
            l.rows as f64 / l.adbc_secs,
            l.adbc_secs,
            l.adbc_bytes as f64 / 1e6,
            l.rows as f64 / l.doget_secs,
            l.doget_secs,
            l.doget_bytes as f64 / 1e6,
            l.doget_secs / l.adbc_secs
        ));
    }
    if lines.is_empty() {
        return;
    }
    println!(
        "
Flight SQL gateway (ADBC DBAPI, one connection) against csd sql:"
    );
    for l in lines {
        println!("  {l}");
    }
}

/// Per layout and link, every query's time and bytes for each system (the median
/// run), and the node's default (adaptive) against DuckDB over HTTP per query.
fn print_per_query(r: &Report) {
    let mut keys: Vec<(String, f64)> = Vec::new();
    for s in r.sequential.iter().filter(|s| s.rate_mbit >= 0.0) {
        if !keys.iter().any(|k| k.0 == s.layout && k.1 == s.rate_mbit) {
            keys.push((s.layout.clone(), s.rate_mbit));
        }
    }
    for (layout, rate) in keys {
        let systems: Vec<&SystemFigures> = r
            .sequential
            .iter()
            .filter(|s| s.layout == layout && (s.rate_mbit == rate || s.rate_mbit < 0.0))
            .collect();
        println!(
            "\nper query, layout {layout}, {} (seconds / MB on the veth):",
            link(rate)
        );
        let mut head = format!("{:<5}", "query");
        for s in &systems {
            head += &format!(" {:>20}", s.system);
        }
        println!("{head}  adaptive/duckdb");
        let Some(first) = systems.first() else {
            continue;
        };
        for q in first.queries.iter().map(|q| q.query) {
            let mut line = format!("q{q:<4}");
            for s in &systems {
                match s.queries.iter().find(|f| f.query == q) {
                    Some(f) => line += &format!(" {:>11.2} {:>8.1}", f.secs, f.bytes / 1e6),
                    None => line += &format!(" {:>20}", ""),
                }
            }
            let of = |name: &str| {
                systems
                    .iter()
                    .find(|s| s.system == name)
                    .and_then(|s| s.queries.iter().find(|f| f.query == q))
            };
            if let (Some(a), Some(d)) = (of("adaptive"), of("duckdb")) {
                line += &format!(
                    "  {:.2}x time, {:.2}x bytes",
                    a.secs / d.secs,
                    a.bytes / d.bytes.max(1.0)
                );
            }
            println!("{line}");
        }
    }
}

/// The node's defaults (adaptive) per layout and link against the better of always
/// and never in time, always in bytes and DuckDB over HTTP; the worst layout last.
fn print_judgement(r: &Report) {
    let mut worst: Option<(f64, String)> = None;
    let mut lines = Vec::new();
    for a in r.sequential.iter().filter(|s| s.system == "adaptive") {
        let (layout, rate) = (&a.layout, a.rate_mbit);
        let always = r.find(layout, "always", rate);
        let never = r.find(layout, "never", rate);
        let best = [always, never]
            .into_iter()
            .flatten()
            .map(|s| s.total_secs)
            .min_by(f64::total_cmp);
        let duck = r.find(layout, "duckdb", rate);
        let mut line = format!(
            "{layout:<6} {:>10}: adaptive {:.2} s",
            link(rate),
            a.total_secs
        );
        if let Some(b) = best {
            line += &format!(
                ", {:+.1}% vs the better of always/never",
                (a.total_secs / b - 1.0) * 100.0
            );
        }
        if let Some(al) = always.filter(|al| al.total_bytes > 0.0) {
            line += &format!(", {:.2}x always's bytes", a.total_bytes / al.total_bytes);
        }
        if let Some(d) = duck {
            let speedup = d.total_secs / a.total_secs;
            line += &format!(
                ", {speedup:.2}x DuckDB-over-HTTP, {:.1}x fewer bytes",
                d.total_bytes / a.total_bytes.max(1.0)
            );
            if worst.as_ref().is_none_or(|w| speedup < w.0) {
                worst = Some((speedup, format!("{layout} at {}", link(rate))));
            }
            // The query the node's default does worst on against DuckDB, in time and
            // in bytes.
            let ratios: Vec<(u32, f64, f64)> = a
                .queries
                .iter()
                .filter_map(|q| {
                    let dq = d.queries.iter().find(|x| x.query == q.query)?;
                    Some((q.query, q.secs / dq.secs, q.bytes / dq.bytes.max(1.0)))
                })
                .collect();
            if let Some(t) = ratios.iter().max_by(|x, y| x.1.total_cmp(&y.1)) {
                line += &format!("; worst query in time q{} {:.2}x DuckDB's", t.0, t.1);
            }
            if let Some(b) = ratios.iter().max_by(|x, y| x.2.total_cmp(&y.2)) {
                line += &format!(", in bytes q{} {:.2}x", b.0, b.2);
            }
        }
        lines.push(line);
    }
    if lines.is_empty() {
        return;
    }
    println!("\nnode defaults by layout:");
    for l in lines {
        println!("  {l}");
    }
    if let Some((speedup, which)) = worst {
        println!("  worst layout: {which}, {speedup:.2}x DuckDB-over-HTTP");
    }
}
