//! What a scenario run measured, and how it is shown: `report.json` (everything),
//! `report.md` (tables, the headline ratio, the plots) and SVG plots.

mod markdown;
pub mod plots;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::scenario::{Point, PolicyName, Scenario, WorkloadSpec, label};
use crate::{Error, Result};

/// Busy fraction of each node's CPU workers at one moment.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct CpuSample {
    /// Seconds since the run started.
    pub t_s: f64,
    /// Per node, running requests ÷ CPU workers.
    pub busy: Vec<f64>,
}

/// One finished query (or one epoch of a feature job).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Done {
    /// Query name (`Q6`, `sql1`, `epoch 1`).
    pub query: String,
    /// When it started, seconds into the run.
    pub start_s: f64,
    /// How long it took.
    pub latency_ms: f64,
    /// Whether it succeeded.
    pub ok: bool,
    /// Why not.
    pub error: Option<String>,
    /// Node requests (fragments, partitions).
    pub fragments: u64,
    /// Of which the node handed back to the compute tier (direct scans aside).
    pub pushed_back: u64,
}

/// One policy at one sweep point.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunResult {
    /// The policy.
    pub policy: PolicyName,
    /// The sweep point.
    pub point: Point,
    /// Wall time of the run, seconds.
    pub wall_s: f64,
    /// Offered arrival rate (open loop), queries/s.
    pub offered_qps: Option<f64>,
    /// Succeeded.
    pub completed: usize,
    /// Failed.
    pub failed: usize,
    /// Still running at the timeout (cancelled).
    pub cut: usize,
    /// Whether the run hit `timeout_s`.
    pub timed_out: bool,
    /// Completed per second.
    pub goodput_qps: f64,
    /// Latency percentiles of completed work, ms.
    pub p50_ms: f64,
    /// 95th percentile.
    pub p95_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Bytes from the nodes to the compute node (through the links).
    pub bytes_from_nodes: u64,
    /// Bytes to the nodes.
    pub bytes_to_nodes: u64,
    /// Node requests and how many were pushed back.
    pub fragments: u64,
    /// See `fragments`.
    pub pushed_back: u64,
    /// Answers that differed from the baseline's.
    pub mismatches: Vec<String>,
    /// First errors (at most 5).
    pub errors: Vec<String>,
    /// Workload-specific figures (split chosen, samples, …).
    pub extra: BTreeMap<String, f64>,
    /// Every finished query.
    pub done: Vec<Done>,
    /// Storage CPU over time.
    pub cpu: Vec<CpuSample>,
}

/// The `p`-quantile of `v` (nearest rank).
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

impl RunResult {
    /// Summarises a run.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        policy: PolicyName,
        wall_s: f64,
        done: Vec<Done>,
        cut: usize,
        timed_out: bool,
        (up, down): (u64, u64),
        cpu: Vec<CpuSample>,
        mismatches: Vec<String>,
        offered_qps: Option<f64>,
    ) -> Self {
        let lat: Vec<f64> = done.iter().filter(|d| d.ok).map(|d| d.latency_ms).collect();
        let completed = lat.len();
        RunResult {
            policy,
            point: vec![],
            wall_s,
            offered_qps,
            completed,
            failed: done.len() - completed,
            cut,
            timed_out,
            goodput_qps: completed as f64 / wall_s.max(1e-9),
            p50_ms: percentile(&lat, 0.5),
            p95_ms: percentile(&lat, 0.95),
            p99_ms: percentile(&lat, 0.99),
            bytes_from_nodes: down,
            bytes_to_nodes: up,
            fragments: done.iter().map(|d| d.fragments).sum(),
            pushed_back: done.iter().map(|d| d.pushed_back).sum(),
            mismatches,
            errors: done
                .iter()
                .filter_map(|d| d.error.clone())
                .take(5)
                .collect(),
            extra: BTreeMap::new(),
            done,
            cpu,
        }
    }

    /// Mean busy fraction of the storage CPUs over the run; `None` when no sample
    /// was taken (a run shorter than the sampling interval).
    pub(crate) fn cpu_mean(&self) -> Option<f64> {
        let v: Vec<f64> = self.cpu.iter().map(|s| mean(&s.busy)).collect();
        (!v.is_empty()).then(|| mean(&v))
    }
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// A whole scenario's results.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// The scenario as run (after `--quick`, if given).
    pub scenario: Scenario,
    /// Whether it was shrunk (`--quick`).
    pub quick: bool,
    /// Cores of this machine (everything shares them).
    pub machine_cores: usize,
    /// The baseline policy.
    pub baseline: PolicyName,
    /// One per (policy, point).
    pub runs: Vec<RunResult>,
    /// Measured cluster capacity for load sweeps (queries/s).
    pub capacity_qps: Option<f64>,
    /// Seconds spent loading data, per cluster started.
    pub load_s: Vec<f64>,
    /// With QEMU guests: seconds from starting QEMU to a serving node (the slowest
    /// guest), per cluster started.
    #[serde(default)]
    pub boot_s: Vec<f64>,
    /// The headline, one line per compared policy.
    pub headline: Vec<String>,
}

/// What the headline and the curves compare.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Metric {
    /// Wall time (closed loop, feature epochs): less is better.
    Time,
    /// Goodput (open loop): more is better.
    Goodput,
}

impl Report {
    fn open_loop(&self) -> bool {
        matches!(
            &self.scenario.workload,
            WorkloadSpec::Sql { rate_qps, load, .. } if rate_qps.is_some() || load.is_some()
        ) || self
            .scenario
            .sweep
            .iter()
            .any(|a| matches!(a.parameter.as_str(), "workload.load" | "workload.rate_qps"))
    }

    fn metric(&self) -> Metric {
        if self.open_loop() {
            Metric::Goodput
        } else {
            Metric::Time
        }
    }

    /// The runs at `point`, in policy order.
    pub fn at(&self, point: &Point) -> Vec<&RunResult> {
        self.scenario
            .policies
            .iter()
            .filter_map(|p| {
                self.runs
                    .iter()
                    .find(|r| r.policy == *p && &r.point == point)
            })
            .collect()
    }

    fn points(&self) -> Vec<Point> {
        let mut out: Vec<Point> = Vec::new();
        for r in &self.runs {
            if !out.contains(&r.point) {
                out.push(r.point.clone());
            }
        }
        out
    }

    /// Headline lines: each policy against the baseline, as ratios over the sweep.
    pub(crate) fn compute_headline(&mut self) {
        let base = self.baseline;
        let metric = self.metric();
        let mut out = Vec::new();
        for p in self.scenario.policies.clone() {
            if p == base {
                continue;
            }
            let mut time = Vec::new();
            let mut bytes = Vec::new();
            for pt in self.points() {
                let (Some(b), Some(r)) = (
                    self.runs.iter().find(|r| r.policy == base && r.point == pt),
                    self.runs.iter().find(|r| r.policy == p && r.point == pt),
                ) else {
                    continue;
                };
                let t = match metric {
                    Metric::Time => b.wall_s / r.wall_s.max(1e-9),
                    Metric::Goodput => r.goodput_qps / b.goodput_qps.max(1e-9),
                };
                time.push((t, label(&pt)));
                bytes.push((
                    b.bytes_from_nodes as f64 / (r.bytes_from_nodes as f64).max(1.0),
                    label(&pt),
                ));
            }
            if time.is_empty() {
                continue;
            }
            // A ratio below 1 reads as its inverse with the opposite word
            // ("3.0x more bytes", not "0.33x fewer"); goodput stays a plain ratio.
            let say = |r: f64, (up, down): (&str, Option<&str>)| match down {
                Some(down) if r < 1.0 => format!("{:.2}x {down}", 1.0 / r.max(1e-9)),
                _ => format!("{r:.2}x {up}"),
            };
            let range = |v: &[(f64, String)], words: (&str, Option<&str>)| -> String {
                let lo = v.iter().min_by(|a, b| a.0.total_cmp(&b.0));
                let hi = v.iter().max_by(|a, b| a.0.total_cmp(&b.0));
                match (lo, hi) {
                    (Some(lo), Some(hi)) if v.len() > 1 => format!(
                        "{} at {} to {} at {}",
                        say(lo.0, words),
                        lo.1,
                        say(hi.0, words),
                        hi.1
                    ),
                    (Some(lo), _) => say(lo.0, words),
                    _ => String::new(),
                }
            };
            let words = match metric {
                Metric::Time => ("less time", Some("more time")),
                Metric::Goodput => ("the goodput", None),
            };
            out.push(format!(
                "**{p} vs {base}**: {}; {}",
                range(&time, words),
                range(
                    &bytes,
                    (
                        "fewer bytes from the nodes",
                        Some("more bytes from the nodes")
                    )
                )
            ));
        }
        self.headline = out;
    }

    /// Writes report.json, report.md and the plots into `dir`.
    pub fn write(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::report(format!("creating {}", dir.display()), e))?;
        let mut written = Vec::new();
        let json = dir.join("report.json");
        let text = serde_json::to_vec_pretty(self).map_err(|e| Error::report("report.json", e))?;
        std::fs::write(&json, text)
            .map_err(|e| Error::report(format!("writing {}", json.display()), e))?;
        written.push(json);
        let plots = self.plots(dir)?;
        let md = dir.join("report.md");
        std::fs::write(&md, self.markdown(&plots))
            .map_err(|e| Error::report(format!("writing {}", md.display()), e))?;
        written.push(md);
        written.extend(
            plots
                .into_iter()
                .filter_map(|f| f.file)
                .map(|p| dir.join(p)),
        );
        Ok(written)
    }
}
