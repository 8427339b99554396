//! # csd-testbed: emulated clusters on one machine
//!
//! "Would pushdown pay on my hardware and network?" A scenario file ([`scenario`])
//! describes storage nodes (count, emulated NVMe timing, CPU and memory budgets), the
//! links to them, a data set (TPC-H, or images for the ML path), a workload (SQL
//! queries from clients or at an arrival rate; or a feature-extraction job) and the
//! policies to compare, optionally swept over link bandwidth, node count, load or
//! selectivity. [`run`] starts real `csd-runtime` nodes on 127.0.0.1
//! (`cluster`), sends real gRPC traffic through [`link`]s that enforce bandwidth
//! and latency, runs the workload under each policy, compares every answer with the
//! baseline's, and writes a [`report`] (Markdown, JSON, SVG plots).
//!
//! * [`link`]: throttled TCP links; the SQL benchmark uses them too.
//! * [`sql`], `pipeline`, `feature_runs`: the workload kinds.

#![warn(unreachable_pub)]

mod cluster;
mod feature_runs;
pub mod guest;
pub mod link;
mod pipeline;
pub mod report;
pub mod scenario;
pub mod sql;
pub mod tpch;

use std::collections::HashMap;
use std::path::PathBuf;

use csd_runtime::admission::Policy;
use indicatif::{ProgressBar, ProgressStyle};

use cluster::{Cluster, NodeKey};
use report::Report;
use scenario::{PolicyName, Scenario, WorkloadSpec, label};

/// What can go wrong.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The scenario file is malformed; the message names the field.
    #[error("bad scenario: {0}")]
    Scenario(String),
    /// Starting nodes or links failed.
    #[error("cluster: {context}: {source}")]
    Cluster {
        /// What was being started.
        context: String,
        /// Why it failed.
        #[source]
        source: csd_runtime::Error,
    },
    /// A node setting of the scenario is invalid.
    #[error(transparent)]
    Node(#[from] csd_runtime::Error),
    /// A node call failed (set-up, not a measured query).
    #[error(transparent)]
    Client(#[from] csd_runtime::node_client::Error),
    /// The ML path failed.
    #[error(transparent)]
    Ml(#[from] csd_ml_pushdown::Error),
    /// DataFusion failed outside a measured query.
    #[error(transparent)]
    Sql(#[from] datafusion::error::DataFusionError),
    /// A tensor operation failed.
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
    /// A QEMU guest could not be built, booted or reached.
    #[error("guest: {0}")]
    Guest(String),
    /// Writing the report failed.
    #[error("report: {context}: {source}")]
    Report {
        /// What was being written.
        context: String,
        /// Why it failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl Error {
    fn report(
        context: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Error::Report {
            context: context.into(),
            source: source.into(),
        }
    }
}

/// Result with the testbed's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How to run a scenario.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Where the report goes.
    pub out: PathBuf,
    /// Shrink the scenario (tests, a first look): see [`Scenario::shrink`].
    pub quick: bool,
    /// Show progress bars on the terminal.
    pub progress: bool,
}

/// The node admission policy a run's policy needs.
fn node_policy(p: PolicyName) -> Policy {
    match p {
        PolicyName::Full => Policy::Always,
        _ => Policy::Adaptive,
    }
}

/// Runs every policy at every sweep point (the baseline first, so that the others'
/// answers are compared with it), then writes the report into `opts.out`.
pub async fn run(mut s: Scenario, opts: &RunOptions) -> Result<Report> {
    if opts.quick {
        s.shrink();
        s.validate()?;
    }
    let points = s.points();
    let cores = csd_runtime::pool::available_cores();
    for pt in &points {
        s.at(pt)?.core_plan(&cores)?;
    }
    let base = s.baseline();
    let mut order = vec![base];
    order.extend(s.policies.iter().copied().filter(|p| *p != base));
    let bar = if opts.progress {
        ProgressBar::new((points.len() * order.len()) as u64).with_style(
            ProgressStyle::with_template("{elapsed_precise} {bar:30} {pos}/{len} runs  {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        )
    } else {
        ProgressBar::hidden()
    };
    let mut cluster: Option<Cluster> = None;
    let mut capacity: Option<f64> = None;
    let mut sql_refs: HashMap<String, sql::References> = HashMap::new();
    let mut ml_refs: HashMap<String, feature_runs::References> = HashMap::new();
    let mut pipeline_refs: HashMap<String, Option<u64>> = HashMap::new();
    let mut runs = Vec::new();
    let mut load_s = Vec::new();
    let mut boot_s = Vec::new();
    for policy in order {
        for pt in &points {
            let at = s.at(pt)?;
            let key = NodeKey::of(&at, node_policy(policy))?;
            let reuse = cluster.as_ref().is_some_and(|c| c.key == key);
            if !reuse {
                if let Some(c) = cluster.take() {
                    c.shutdown().await;
                }
                bar.set_message(format!("starting {} node(s)", at.nodes.count));
                let c = Cluster::start(&at, key, |m| bar.set_message(m)).await?;
                load_s.push(c.load_s);
                boot_s.extend(c.boot_s);
                cluster = Some(c);
            }
            let Some(c) = cluster.as_ref() else {
                return Err(Error::Cluster {
                    context: "running a point".into(),
                    source: csd_runtime::Error::Internal("no cluster was started".into()),
                });
            };
            bar.set_message(format!("{policy} at {}", label(pt)));
            let links = c.links(&at).await?;
            let result = match at.workload {
                WorkloadSpec::Sql { .. } => {
                    sql::run(
                        &at,
                        c,
                        &links,
                        policy,
                        sql_refs.entry(label(pt)).or_default(),
                        &mut capacity,
                        &bar,
                    )
                    .await
                }
                WorkloadSpec::Pipeline { .. } => {
                    pipeline::run(
                        &at,
                        c,
                        &links,
                        policy,
                        pipeline_refs.entry(label(pt)).or_default(),
                        &bar,
                    )
                    .await
                }
                WorkloadSpec::Features { .. } => {
                    feature_runs::run(
                        &at,
                        c,
                        &links,
                        policy,
                        ml_refs.entry(label(pt)).or_default(),
                        &bar,
                    )
                    .await
                }
            };
            links.shutdown().await;
            let mut r = result?;
            r.point = pt.clone();
            let line = format!(
                "{:<13} {:<40} {:>8.2} s  {:>5} ok {:>3} failed  {:>10.3} MB from nodes  p99 {:>8.1} ms{}",
                policy.to_string(),
                label(pt),
                r.wall_s,
                r.completed,
                r.failed,
                r.bytes_from_nodes as f64 / 1e6,
                r.p99_ms,
                if r.mismatches.is_empty() {
                    String::new()
                } else {
                    format!("  {} ANSWERS DIFFER", r.mismatches.len())
                }
            );
            if opts.progress && bar.is_hidden() {
                // Not a terminal: one line per run instead of a bar.
                eprintln!("{line}");
            } else {
                bar.println(line);
            }
            bar.inc(1);
            runs.push(r);
        }
    }
    if let Some(c) = cluster {
        c.shutdown().await;
    }
    bar.finish_and_clear();
    let mut report = Report {
        baseline: base,
        scenario: s,
        quick: opts.quick,
        machine_cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        runs,
        capacity_qps: capacity,
        load_s,
        boot_s,
        headline: vec![],
    };
    report.compute_headline();
    report.write(&opts.out)?;
    Ok(report)
}
