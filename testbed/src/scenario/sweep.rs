//! What a scenario sweeps ([`SweepAxis`]): the parameters it may vary, the points
//! of the sweep, and the scenario at each.

use serde::{Deserialize, Serialize};

use super::{MAX_NODES, MAX_WORKERS, Scenario, WorkloadSpec, bad, inner, whole};
use crate::Result;

/// One swept parameter.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SweepAxis {
    /// One of `SWEEPABLE`.
    pub parameter: String,
    /// Its values, in the order to run them.
    pub values: Vec<f64>,
}

/// Parameters a sweep may vary.
pub(crate) const SWEEPABLE: [&str; 9] = [
    "compute.workers",
    "link.bandwidth_mbit",
    "link.latency_us",
    "nodes.count",
    "nodes.cpus",
    "workload.selectivity",
    "workload.load",
    "workload.rate_qps",
    "workload.clients",
];

/// One point of a sweep: (parameter, value) per axis.
pub(crate) type Point = Vec<(String, f64)>;

impl Scenario {
    /// Sets a sweepable parameter, checking the result.
    pub fn set(&mut self, parameter: &str, v: f64) -> Result<()> {
        self.set_raw(parameter, v)?;
        self.validate()
    }

    pub(super) fn set_raw(&mut self, parameter: &str, v: f64) -> Result<()> {
        match parameter {
            "link.bandwidth_mbit" => {
                self.link.bandwidth_mbit = v;
                for l in &mut self.links {
                    l.bandwidth_mbit = v;
                }
            }
            "link.latency_us" => {
                self.link.latency_us = v;
                for l in &mut self.links {
                    l.latency_us = v;
                }
            }
            "nodes.count" => self.nodes.count = whole(parameter, v, 1, MAX_NODES)?,
            "compute.workers" => self.compute.workers = whole(parameter, v, 0, MAX_WORKERS)?,
            "nodes.cpus" => self.nodes.settings.cpus = whole(parameter, v, 1, 64)?,
            p => {
                let WorkloadSpec::Sql {
                    selectivity,
                    load,
                    rate_qps,
                    clients,
                    ..
                } = &mut self.workload
                else {
                    return Err(bad(p, "applies to SQL workloads"));
                };
                match p {
                    "workload.selectivity" => *selectivity = Some(v),
                    "workload.load" => {
                        *load = Some(v);
                        *rate_qps = None;
                    }
                    "workload.rate_qps" => {
                        *rate_qps = Some(v);
                        *load = None;
                    }
                    "workload.clients" => *clients = whole(p, v, 1, 256)?,
                    _ => return Err(bad(p, "cannot be swept")),
                }
            }
        }
        Ok(())
    }

    /// Every sweep point (one empty point when nothing is swept), first axis
    /// varying slowest.
    pub fn points(&self) -> Vec<Point> {
        let mut out: Vec<Point> = vec![vec![]];
        for a in &self.sweep {
            out = out
                .into_iter()
                .flat_map(|p| {
                    a.values.iter().map(move |v| {
                        let mut q = p.clone();
                        q.push((a.parameter.clone(), *v));
                        q
                    })
                })
                .collect();
        }
        out
    }

    /// The scenario at one sweep point.
    pub fn at(&self, point: &Point) -> Result<Scenario> {
        let mut s = self.clone();
        s.sweep.clear();
        for (p, v) in point {
            s.set_raw(p, *v)?;
        }
        s.validate()?;
        Ok(s)
    }

    /// The sweep's part of [`Scenario::validate`]: each value makes a valid
    /// scenario.
    pub(super) fn validate_sweep(&self) -> Result<()> {
        let sql = matches!(self.workload, WorkloadSpec::Sql { .. });
        if self.sweep.len() > 2 {
            return Err(bad(
                "sweep",
                "at most two axes (a curve per value of the second)",
            ));
        }
        for (i, a) in self.sweep.iter().enumerate() {
            let field = format!("sweep[{i}]");
            if !SWEEPABLE.contains(&a.parameter.as_str()) {
                return Err(bad(
                    &format!("{field}.parameter"),
                    format!(
                        "{:?} cannot be swept; expected one of {}",
                        a.parameter,
                        SWEEPABLE.join(", ")
                    ),
                ));
            }
            if a.values.is_empty() || a.values.len() > 64 {
                return Err(bad(&format!("{field}.values"), "expected 1 to 64 values"));
            }
            if self.sweep[..i].iter().any(|b| b.parameter == a.parameter) {
                return Err(bad(&format!("{field}.parameter"), "swept twice"));
            }
            if a.parameter.starts_with("workload.") && !sql {
                return Err(bad(
                    &format!("{field}.parameter"),
                    "workload parameters apply to SQL workloads",
                ));
            }
            // Each value must make a valid scenario (the other axes at their first).
            for v in &a.values {
                let mut s = self.clone();
                s.sweep.clear();
                for b in &self.sweep {
                    if b.parameter != a.parameter && !b.values.is_empty() {
                        s.set_raw(&b.parameter, b.values[0])?;
                    }
                }
                s.set_raw(&a.parameter, *v)
                    .and_then(|()| s.validate())
                    .map_err(|e| bad(&format!("{field}.values"), format!("{v}: {}", inner(e))))?;
            }
        }
        Ok(())
    }
}
