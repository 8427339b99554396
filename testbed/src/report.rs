//! What a scenario run measured, and how it is shown: `report.json` (everything),
//! `report.md` (tables, the headline ratio, the plots) and SVG plots.

use std::collections::BTreeMap;
use std::fmt::Write as _;
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

    fn markdown(&self, plots: &[Figure]) -> String {
        let s = &self.scenario;
        let mut m = String::new();
        let _ = writeln!(m, "# Testbed: {}\n", s.name);
        if !s.description.is_empty() {
            let _ = writeln!(m, "{}\n", s.description.trim());
        }
        if self.quick {
            let _ = writeln!(m, "*Quick run (`--quick`): smaller data, shorter runs.*\n");
        }
        let _ = writeln!(m, "## Headline\n");
        for h in &self.headline {
            let _ = writeln!(m, "- {h}");
        }
        let bad: usize = self.runs.iter().map(|r| r.mismatches.len()).sum();
        let _ = writeln!(
            m,
            "- Answers compared with the baseline ({}): {}",
            self.baseline,
            if bad == 0 {
                "all equal".to_string()
            } else {
                format!("**{bad} differ** (see below)")
            }
        );
        let _ = writeln!(m, "\n## Set-up\n");
        let d = &s.nodes.device;
        let _ = writeln!(
            m,
            "- {} storage node(s), {} CPU worker(s) and {} memory each; emulated NVMe: {} µs, {} MB/s read, queue depth {}, parallelism {}",
            s.nodes.count,
            s.nodes.cpus,
            s.nodes.memory,
            d.latency_us,
            d.read_mbps,
            d.queue_depth,
            d.parallelism
        );
        let _ = writeln!(
            m,
            "- Link per node: {} Mbit/s, {} µs one way{}",
            s.link.bandwidth_mbit,
            s.link.latency_us,
            if s.links.is_empty() {
                ""
            } else {
                " (some nodes overridden)"
            }
        );
        let _ = writeln!(
            m,
            "- Data: `{}`",
            serde_json::to_string(&s.data).unwrap_or_default()
        );
        let _ = writeln!(
            m,
            "- Workload: `{}`",
            serde_json::to_string(&s.workload).unwrap_or_default()
        );
        if let Some(c) = self.capacity_qps {
            let _ = writeln!(m, "- Measured capacity: {c:.2} queries/s");
        }
        if s.nodes.pin {
            let _ = writeln!(
                m,
                "- Pinned (`nodes.pin`): each node's operator workers have cores of their own, \
                 and the compute tier's ML work the rest of this machine's {} cores; gRPC, \
                 links and the compute tier's SQL share all of them.",
                self.machine_cores
            );
        } else {
            let _ = writeln!(
                m,
                "- Everything shares this machine's {} cores (nodes, links, compute).",
                self.machine_cores
            );
        }
        let _ = writeln!(m, "\n## Results\n");
        let features = matches!(s.workload, WorkloadSpec::Features { .. });
        for pt in self.points() {
            if !pt.is_empty() {
                let _ = writeln!(m, "### {}\n", label(&pt));
            }
            let runs = self.at(&pt);
            let base = runs.iter().find(|r| r.policy == self.baseline).copied();
            let _ = writeln!(
                m,
                "| policy | wall s | ok / failed / cut | goodput /s | p50 ms | p99 ms | MB from nodes | bytes ÷ | time ÷ | pushed back | CPU busy |{}",
                if features { " split |" } else { "" }
            );
            let _ = writeln!(
                m,
                "|---|---|---|---|---|---|---|---|---|---|---|{}",
                if features { "---|" } else { "" }
            );
            for r in runs {
                let (bx, tx) = match base {
                    Some(b) => (
                        format!(
                            "{:.1}x",
                            b.bytes_from_nodes as f64 / (r.bytes_from_nodes as f64).max(1.0)
                        ),
                        format!("{:.2}x", b.wall_s / r.wall_s.max(1e-9)),
                    ),
                    None => ("-".into(), "-".into()),
                };
                let _ = writeln!(
                    m,
                    "| {} | {:.2} | {} / {} / {} | {:.2} | {:.1} | {:.1} | {:.3} | {} | {} | {}/{} | {} |{}",
                    r.policy,
                    r.wall_s,
                    r.completed,
                    r.failed,
                    r.cut,
                    r.goodput_qps,
                    r.p50_ms,
                    r.p99_ms,
                    r.bytes_from_nodes as f64 / 1e6,
                    bx,
                    tx,
                    r.pushed_back,
                    r.fragments,
                    r.cpu_mean()
                        .map_or("not sampled".to_string(), |c| format!("{:.0}%", c * 100.0)),
                    if features {
                        format!(
                            " {} |",
                            r.extra
                                .get("split")
                                .map(|k| k.to_string())
                                .unwrap_or("-".into())
                        )
                    } else {
                        String::new()
                    }
                );
            }
            let _ = writeln!(m);
            for r in self.at(&pt) {
                for e in &r.mismatches {
                    let _ = writeln!(m, "- **{}: {e}**", r.policy);
                }
                for e in &r.errors {
                    let _ = writeln!(m, "- {} error: {e}", r.policy);
                }
                if r.timed_out {
                    let _ = writeln!(m, "- {} hit the {} s timeout", r.policy, s.timeout_s);
                }
            }
        }
        let _ = writeln!(m, "\n## Plots\n");
        for f in plots {
            match &f.file {
                Some(file) => {
                    let _ = writeln!(m, "### {}\n\n![{}]({file})\n", f.title, f.title);
                }
                None => {
                    let _ = writeln!(m, "### {}\n\nNot drawn: {}\n", f.title, f.missing);
                }
            }
        }
        let _ = writeln!(
            m,
            "Storage CPU is the fraction of the nodes' CPU workers running pushed-down work, sampled every 100 ms (raw Parquet reads are not counted). Bytes are what crossed the throttled links from the nodes."
        );
        m
    }

    /// Draws the plots; returns each figure's title and file, or why there is none.
    fn plots(&self, dir: &Path) -> Result<Vec<Figure>> {
        let mut out = Vec::new();
        let points = self.points();
        let axes = &self.scenario.sweep;
        let metric = self.metric();
        let (mname, mfile, mval): (&str, &str, fn(&RunResult) -> f64) = match metric {
            Metric::Time => ("wall time (s)", "time", |r| r.wall_s),
            Metric::Goodput => ("goodput (queries/s)", "goodput", |r| r.goodput_qps),
        };
        type Plot = (&'static str, &'static str, fn(&RunResult) -> f64, bool);
        let metrics: [Plot; 3] = [
            (mname, mfile, mval, false),
            (
                "MB from the nodes",
                "bytes",
                |r| r.bytes_from_nodes as f64 / 1e6,
                true,
            ),
            ("p99 latency (ms)", "p99", |r| r.p99_ms, false),
        ];
        for (ydesc, file, f, log_y) in metrics {
            let name = format!("{file}.svg");
            let mut series = Vec::new();
            let (xdesc, log_x, ticks) = if axes.is_empty() {
                // One point: policies along x.
                let pts = self
                    .at(&vec![])
                    .iter()
                    .enumerate()
                    .map(|(i, r)| (i as f64, f(r)))
                    .collect();
                series.push(("all policies".to_string(), pts));
                let names: Vec<String> = self
                    .scenario
                    .policies
                    .iter()
                    .map(|p| p.to_string())
                    .collect();
                ("policy".to_string(), false, Some(names))
            } else {
                let a0 = &axes[0];
                let seconds: Vec<Option<(String, f64)>> = match axes.get(1) {
                    Some(a1) => a1
                        .values
                        .iter()
                        .map(|v| Some((a1.parameter.clone(), *v)))
                        .collect(),
                    None => vec![None],
                };
                for p in &self.scenario.policies {
                    for sv in &seconds {
                        let pts: Vec<(f64, f64)> = self
                            .runs
                            .iter()
                            .filter(|r| r.policy == *p)
                            .filter(|r| match sv {
                                Some((n, v)) => r.point.iter().any(|(pn, pv)| pn == n && pv == v),
                                None => true,
                            })
                            .filter_map(|r| {
                                let x = r.point.iter().find(|(n, _)| *n == a0.parameter)?.1;
                                Some((x, f(r)))
                            })
                            .collect();
                        let name = match sv {
                            Some((n, v)) => {
                                format!("{p}, {}={v}", n.rsplit('.').next().unwrap_or(n))
                            }
                            None => p.to_string(),
                        };
                        series.push((name, pts));
                    }
                }
                let log_x = a0.values.iter().all(|v| *v > 0.0)
                    && a0.values.iter().cloned().fold(0.0, f64::max)
                        / a0.values.iter().cloned().fold(f64::INFINITY, f64::min)
                        >= 20.0;
                (a0.parameter.clone(), log_x, None)
            };
            let title = format!("{} — {ydesc}", self.scenario.name);
            line_chart(
                &dir.join(&name),
                &title,
                &xdesc,
                ydesc,
                &series,
                log_x,
                log_y,
                ticks.as_deref(),
                axes.get(1).map_or(1, |a| a.values.len()),
            )?;
            out.push(Figure::drawn(ydesc, name));
        }
        for (i, pt) in points.iter().enumerate() {
            let suffix = if points.len() == 1 {
                String::new()
            } else {
                format!("-{i}")
            };
            let runs = self.at(pt);
            let lat: Vec<(String, Vec<(f64, f64)>)> = runs
                .iter()
                .map(|r| {
                    let mut v: Vec<f64> = r
                        .done
                        .iter()
                        .filter(|d| d.ok)
                        .map(|d| d.latency_ms)
                        .collect();
                    v.sort_by(f64::total_cmp);
                    let n = v.len().max(1) as f64;
                    let pts = v
                        .iter()
                        .enumerate()
                        .map(|(k, l)| (*l, (k + 1) as f64 / n))
                        .collect();
                    (r.policy.to_string(), pts)
                })
                .collect();
            let name = format!("latency{suffix}.svg");
            let title = format!("Latency CDF, {}", label(pt));
            if lat.iter().all(|(_, pts)| pts.len() < MIN_DISTRIBUTION) {
                let each: Vec<String> = lat
                    .iter()
                    .map(|(p, pts)| {
                        let ms: Vec<String> =
                            pts.iter().map(|(l, _)| format!("{l:.1} ms")).collect();
                        format!(
                            "{p}: {}",
                            if ms.is_empty() {
                                "none".into()
                            } else {
                                ms.join(", ")
                            }
                        )
                    })
                    .collect();
                out.push(Figure::missing(
                    title,
                    format!(
                        "fewer than {MIN_DISTRIBUTION} completed queries per policy, too few for a distribution ({})",
                        each.join("; ")
                    ),
                ));
            } else {
                line_chart(
                    &dir.join(&name),
                    &format!("Latency distribution ({})", label(pt)),
                    "latency (ms)",
                    "fraction completed within",
                    &lat,
                    false,
                    false,
                    None,
                    1,
                )?;
                out.push(Figure::drawn(title, name));
            }
            let cpu: Vec<(String, Vec<(f64, f64)>)> = runs
                .iter()
                .map(|r| {
                    (
                        r.policy.to_string(),
                        r.cpu
                            .iter()
                            .map(|s| (s.t_s, mean(&s.busy) * 100.0))
                            .collect(),
                    )
                })
                .collect();
            let name = format!("cpu{suffix}.svg");
            let title = format!("Storage CPU over time, {}", label(pt));
            if cpu.iter().all(|(_, pts)| pts.is_empty()) {
                out.push(Figure::missing(
                    title,
                    "no CPU sample was taken: every run ended within the 100 ms sampling interval",
                ));
            } else {
                line_chart(
                    &dir.join(&name),
                    &format!("Storage CPU use ({})", label(pt)),
                    "seconds into the run",
                    "CPU workers busy (%)",
                    &cpu,
                    false,
                    false,
                    None,
                    1,
                )?;
                out.push(Figure::drawn(title, name));
            }
        }
        Ok(out)
    }
}

/// Fewest points a latency CDF is drawn from.
const MIN_DISTRIBUTION: usize = 2;

/// One figure of a report: drawn into `file`, or not drawn for the reason `missing`.
#[derive(Debug)]
struct Figure {
    title: String,
    file: Option<String>,
    missing: String,
}

impl Figure {
    fn drawn(title: impl Into<String>, file: String) -> Self {
        Figure {
            title: title.into(),
            file: Some(file),
            missing: String::new(),
        }
    }

    fn missing(title: impl Into<String>, why: impl Into<String>) -> Self {
        Figure {
            title: title.into(),
            file: None,
            missing: why.into(),
        }
    }
}

/// A tick label: `v` to six significant digits, without float noise
/// (`0.060000000000000005` is `0.06`).
pub fn tick(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return if v.is_finite() {
            "0".into()
        } else {
            format!("{v}")
        };
    }
    let digits = 6 - 1 - v.abs().log10().floor() as i32;
    let scale = 10f64.powi(digits.clamp(-300, 300));
    let r = (v * scale).round() / scale;
    let text = format!("{r}");
    if text.len() > 12 {
        format!("{r:.3e}")
    } else {
        text
    }
}

/// An SVG line chart of `series` (name, points). `ticks` labels integer x values
/// (categories). Series come in groups of `shades`: one hue per group (policy),
/// lighter within it (second swept parameter). Empty series are skipped.
#[allow(clippy::too_many_arguments)]
pub fn line_chart(
    path: &Path,
    title: &str,
    xdesc: &str,
    ydesc: &str,
    series: &[(String, Vec<(f64, f64)>)],
    log_x: bool,
    log_y: bool,
    ticks: Option<&[String]>,
    shades: usize,
) -> Result<()> {
    draw(
        path,
        title,
        xdesc,
        ydesc,
        series,
        log_x,
        log_y,
        ticks,
        shades.max(1),
    )
    .map_err(|e| Error::report(format!("drawing {}", path.display()), e.to_string()))
}

#[allow(clippy::too_many_arguments)]
fn draw(
    path: &Path,
    title: &str,
    xdesc: &str,
    ydesc: &str,
    series: &[(String, Vec<(f64, f64)>)],
    log_x: bool,
    log_y: bool,
    ticks: Option<&[String]>,
    shades: usize,
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    const HUES: [RGBColor; 6] = [
        RGBColor(214, 39, 40),
        RGBColor(31, 119, 180),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
        RGBColor(255, 127, 14),
        RGBColor(23, 190, 207),
    ];
    let all: Vec<(f64, f64)> = series.iter().flat_map(|s| s.1.iter().copied()).collect();
    let fold = |f: fn(&(f64, f64)) -> f64, lo: bool| {
        all.iter().map(f).fold(
            if lo { f64::INFINITY } else { f64::NEG_INFINITY },
            |a, b| {
                if lo { a.min(b) } else { a.max(b) }
            },
        )
    };
    let (mut x0, mut x1) = (fold(|p| p.0, true), fold(|p| p.0, false));
    let (mut y0, mut y1) = (fold(|p| p.1, true), fold(|p| p.1, false));
    if !x0.is_finite() {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if ticks.is_some() {
        x0 -= 0.5;
        x1 += 0.5;
    }
    let (x0, x1) = if log_x {
        (x0.max(1e-9) / 1.3, x1 * 1.3)
    } else {
        (x0, x1)
    };
    let (y0, y1) = if log_y {
        (y0.max(1e-6) / 2.0, y1.max(1e-6) * 2.0)
    } else {
        (y0.min(0.0), if y1 > 0.0 { y1 * 1.1 } else { 1.0 })
    };
    let root = SVGBackend::new(path, (760, 460)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(64);
    macro_rules! finish {
        ($chart:expr) => {{
            let mut chart = $chart;
            let mut mesh = chart.configure_mesh();
            mesh.x_desc(xdesc).y_desc(ydesc);
            let fmt = |x: &f64| match ticks {
                Some(t) if x.fract() == 0.0 && *x >= 0.0 => {
                    t.get(*x as usize).cloned().unwrap_or_default()
                }
                Some(_) => String::new(),
                None => tick(*x),
            };
            let yfmt = |y: &f64| tick(*y);
            mesh.x_label_formatter(&fmt);
            mesh.y_label_formatter(&yfmt);
            mesh.draw()?;
            for (i, (name, pts)) in series.iter().enumerate() {
                if pts.is_empty() {
                    continue;
                }
                let RGBColor(r, g, b) = HUES[(i / shades) % HUES.len()];
                // Lighter for later values of the second parameter.
                let t = (i % shades) as f64 / (shades as f64 + 0.5);
                let mix = |c: u8| (c as f64 + (255.0 - c as f64) * t * 0.8) as u8;
                let color = RGBColor(mix(r), mix(g), mix(b)).to_rgba();
                chart
                    .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
                    .label(name.as_str())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color));
                if pts.len() < 64 {
                    chart.draw_series(
                        pts.iter()
                            .map(|&(x, y)| Circle::new((x, y), 3, color.filled())),
                    )?;
                }
            }
            chart
                .configure_series_labels()
                .border_style(BLACK)
                .background_style(WHITE.mix(0.8))
                .draw()?;
        }};
    }
    match (log_x, log_y) {
        (false, false) => finish!(builder.build_cartesian_2d(x0..x1, y0..y1)?),
        (true, false) => finish!(builder.build_cartesian_2d((x0..x1).log_scale(), y0..y1)?),
        (false, true) => finish!(builder.build_cartesian_2d(x0..x1, (y0..y1).log_scale())?),
        (true, true) => {
            finish!(builder.build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())?)
        }
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_carry_no_float_noise() {
        assert_eq!(tick(0.060000000000000005), "0.06");
        assert_eq!(tick(0.09999999999), "0.1");
        assert_eq!(tick(1500.0), "1500");
        assert_eq!(tick(0.0), "0");
        assert_eq!(tick(-2.5), "-2.5");
    }
}
