//! What one query process took (time, bytes on the veth, what it reported) and the
//! medians and table the bench prints and writes.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Instant;

use serde::Serialize;

use crate::net::Net;

/// One finished query process.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Run {
    pub(crate) secs: f64,
    pub(crate) bytes: u64,
    /// The query time the process reported (DuckDB: after loading; csd: the node's
    /// run time summed over fragments, less queueing).
    pub(crate) inner_ms: Option<f64>,
    pub(crate) handed_back: Option<u64>,
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
    Run {
        secs,
        bytes,
        inner_ms,
        handed_back,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
    }
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
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
pub(crate) struct QueryFigures {
    pub(crate) query: u32,
    pub(crate) secs: f64,
    pub(crate) bytes: f64,
    pub(crate) inner_ms: Option<f64>,
    pub(crate) handed_back: Option<f64>,
    pub(crate) runs: Vec<Run>,
}

#[derive(Serialize, Clone)]
pub(crate) struct SystemFigures {
    pub(crate) system: String,
    pub(crate) rate_mbit: f64,
    pub(crate) total_secs: f64,
    pub(crate) total_bytes: f64,
    pub(crate) total_inner_ms: Option<f64>,
    pub(crate) queries: Vec<QueryFigures>,
}

#[derive(Serialize)]
pub(crate) struct Report {
    pub(crate) scale: f64,
    pub(crate) runs: usize,
    pub(crate) measured_mbit: BTreeMap<String, f64>,
    pub(crate) sequential: Vec<SystemFigures>,
    pub(crate) concurrent: Vec<ConcurrentFigures>,
    pub(crate) mismatches: Vec<String>,
}

#[derive(Serialize)]
pub(crate) struct ConcurrentFigures {
    pub(crate) system: String,
    pub(crate) rate_mbit: f64,
    pub(crate) clients: usize,
    pub(crate) wall_secs: f64,
    pub(crate) bytes: u64,
}

pub(crate) fn print_report(r: &Report) {
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
