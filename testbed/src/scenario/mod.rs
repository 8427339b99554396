//! Scenario files: the cluster, the data, the workload, the policies to compare and
//! the parameters to sweep, in TOML.
//!
//! Parsing rejects unknown keys and wrong types with the TOML parser's message (line,
//! column, key, what was expected); [`Scenario::validate`] then checks ranges and
//! combinations and names the field (`nodes.count: expected 1 to 16, got 0`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

mod nodes;
mod policy;
mod sweep;
#[cfg(test)]
mod tests;
mod workload;

pub(crate) use nodes::CorePlan;
pub use nodes::{ComputeSpec, DeviceConf, GuestDevice, LinkConf, NodeSystem, NodesSpec, QemuConf};
pub use policy::PolicyName;
pub(crate) use sweep::Point;
pub use sweep::SweepAxis;
pub use workload::{DataSpec, QueryRef, WasmFunctionSpec, WorkloadSpec};

use crate::{Error, Result};

/// Most storage nodes one scenario may start (all on this machine).
pub(crate) const MAX_NODES: usize = 16;
/// Most compute-tier workers a scenario starts.
pub(crate) const MAX_WORKERS: usize = 16;
/// Longest a single run (one policy at one sweep point) may take, seconds.
pub(crate) const MAX_TIMEOUT_S: f64 = 1800.0;

/// A whole scenario.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Short name, used in the report's title.
    pub name: String,
    /// What the scenario asks.
    #[serde(default)]
    pub description: String,
    /// The storage nodes.
    pub nodes: NodesSpec,
    /// The compute node.
    #[serde(default)]
    pub compute: ComputeSpec,
    /// The link between the compute node and each storage node.
    #[serde(default)]
    pub link: LinkConf,
    /// Per-node links overriding `link` (node `i` uses entry `i`, if present).
    #[serde(default)]
    pub links: Vec<LinkConf>,
    /// The data set.
    pub data: DataSpec,
    /// The workload.
    pub workload: WorkloadSpec,
    /// Policies to compare, in order. SQL: `none`, `full`, `adaptive`; features:
    /// `compute-only`, `full`, `auto`, `split:N`.
    pub policies: Vec<PolicyName>,
    /// The policy the others are compared with (default: the first).
    #[serde(default)]
    pub baseline: Option<PolicyName>,
    /// Parameters to sweep (the product of all axes is run).
    #[serde(default)]
    pub sweep: Vec<SweepAxis>,
    /// Each run (one policy at one sweep point) is stopped after this many seconds.
    #[serde(default = "default_timeout")]
    pub timeout_s: f64,
}

fn default_timeout() -> f64 {
    300.0
}

pub(super) fn bad(field: &str, why: impl std::fmt::Display) -> Error {
    Error::Scenario(format!("{field}: {why}"))
}

/// The message of a scenario error, without the "bad scenario" prefix.
pub(super) fn inner(e: Error) -> String {
    match e {
        Error::Scenario(m) => m,
        other => other.to_string(),
    }
}

pub(super) fn whole(field: &str, v: f64, lo: usize, hi: usize) -> Result<usize> {
    if v.fract() != 0.0 || v < lo as f64 || v > hi as f64 {
        return Err(bad(
            field,
            format!("expected a whole number from {lo} to {hi}, got {v}"),
        ));
    }
    Ok(v as usize)
}

impl Scenario {
    /// An images scenario's model and its weights.
    pub(crate) fn image_model(&self) -> Result<(csd_ml_pushdown::Arch, Vec<u8>)> {
        let DataSpec::Images { model, weights, .. } = &self.data else {
            return Err(Error::Scenario("data.kind: expected \"images\"".into()));
        };
        let arch: csd_ml_pushdown::Arch = model.parse()?;
        let path = weights
            .as_deref()
            .map(expand)
            .unwrap_or_else(|| csd_ml_pushdown::assets_dir().join(format!("{model}.safetensors")));
        let bytes = std::fs::read(&path).map_err(|e| {
            Error::Scenario(format!(
                "data.weights: {}: {e} (run scripts/setup-ml.sh for the default weights)",
                path.display()
            ))
        })?;
        Ok((arch, bytes))
    }

    /// Reads and checks a scenario file. Relative data paths are resolved against the
    /// file's folder.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Scenario(format!("reading {}: {e}", path.display())))?;
        let mut s = Self::parse(&text).map_err(|e| match e {
            Error::Scenario(m) => Error::Scenario(format!("{}: {m}", path.display())),
            other => other,
        })?;
        if let Some(base) = path.parent() {
            s.resolve_paths(base);
        }
        Ok(s)
    }

    /// Parses and checks scenario text.
    pub fn parse(text: &str) -> Result<Self> {
        let s: Scenario = toml::from_str(text).map_err(|e| Error::Scenario(e.to_string()))?;
        s.validate()?;
        Ok(s)
    }

    fn resolve_paths(&mut self, base: &Path) {
        if let WorkloadSpec::Sql { wasm_functions, .. } = &mut self.workload {
            for f in wasm_functions {
                f.module = expand(&f.module);
                if f.module.is_relative() {
                    f.module = base.join(&f.module);
                }
            }
        }
        if let DataSpec::Images {
            dir,
            labels,
            weights,
            ..
        } = &mut self.data
        {
            for p in [dir, labels, weights].into_iter().flatten() {
                *p = expand(p);
                if p.is_relative() {
                    *p = base.join(&*p);
                }
            }
        }
    }

    /// Checks ranges and combinations; the error names the field.
    pub fn validate(&self) -> Result<()> {
        if self.name.trim().is_empty() {
            return Err(bad("name", "expected a non-empty name"));
        }
        self.validate_cluster()?;
        self.validate_workload()?;
        self.validate_policies()?;
        if !(self.timeout_s.is_finite() && self.timeout_s > 0.0 && self.timeout_s <= MAX_TIMEOUT_S)
        {
            return Err(bad(
                "timeout_s",
                format!("expected 0 < seconds ≤ {MAX_TIMEOUT_S}"),
            ));
        }
        self.validate_sweep()
    }

    /// With `nodes.pin`: each node's cores and the compute tier's, out of `available`.
    pub(crate) fn core_plan(&self, available: &[usize]) -> Result<Option<CorePlan>> {
        if !self.nodes.pin {
            return Ok(None);
        }
        let need = self.nodes.count * self.nodes.settings.cpus;
        if need >= available.len() {
            return Err(bad(
                "nodes.pin",
                format!(
                    "{} node(s) × {} cpus need {need} cores, plus at least one for the compute \
                     node; this machine lets us use {} ({available:?})",
                    self.nodes.count,
                    self.nodes.settings.cpus,
                    available.len()
                ),
            ));
        }
        Ok(Some(CorePlan {
            nodes: available[..need]
                .chunks(self.nodes.settings.cpus)
                .map(<[usize]>::to_vec)
                .collect(),
            compute: available[need..].to_vec(),
        }))
    }

    /// The device spec every node gets (`emulated:mem,...`).
    pub(crate) fn device_spec(&self) -> Result<String> {
        if self.nodes.system == nodes::NodeSystem::Qemu {
            let q = &self.nodes.qemu;
            return Ok(match q.arch {
                crate::guest::Arch::X86_64 => format!("qemu:{}", q.device.spec()),
                arch => format!("qemu-{}:{}", arch.name(), q.device.spec()),
            });
        }
        let d = &self.nodes.device;
        let spec = format!(
            "emulated:mem,latency_us={},read_mbps={},write_mbps={},queue_depth={},parallelism={}",
            d.latency_us, d.read_mbps, d.write_mbps, d.queue_depth, d.parallelism
        );
        spec.parse::<csd_runtime::device::DeviceSpec>()
            .map_err(|e| bad("nodes.device", e))?;
        Ok(spec)
    }

    /// The baseline policy.
    pub fn baseline(&self) -> PolicyName {
        self.baseline.unwrap_or(self.policies[0])
    }

    /// Partitions in all.
    pub fn partitions(&self) -> usize {
        match &self.data {
            DataSpec::Tpch { partitions, .. } | DataSpec::Images { partitions, .. } => {
                partitions.unwrap_or(2 * self.nodes.count)
            }
        }
    }

    /// The link to node `i`.
    pub(crate) fn link_of(&self, i: usize) -> LinkConf {
        self.links.get(i).copied().unwrap_or(self.link)
    }

    /// Makes every run small and short, for tests and `--quick`: scale ÷10 (at
    /// least 0.01), durations ≤ 2 s, repetitions 1, at most 2 values per axis.
    pub fn shrink(&mut self) {
        if let DataSpec::Tpch { scale, .. } = &mut self.data {
            *scale = (*scale / 10.0).max(0.01);
        }
        if let DataSpec::Images { repeat, .. } = &mut self.data {
            *repeat = 1;
        }
        if let WorkloadSpec::Sql {
            duration_s,
            repetitions,
            ..
        } = &mut self.workload
        {
            *duration_s = duration_s.map(|d| d.min(2.0));
            *repetitions = repetitions.map(|_| 1);
        }
        if let WorkloadSpec::Pipeline { repetitions, .. } = &mut self.workload {
            *repetitions = 1;
        }
        for a in &mut self.sweep {
            if a.values.len() > 2 {
                a.values = vec![a.values[0], a.values[a.values.len() - 1]];
            }
        }
    }
}

/// `$CSD_ML_HOME/...` → the ML assets folder (`scripts/setup-ml.sh`'s; set or not);
/// `$CSD_WASM/...` → the example guests (`$CARGO_TARGET_DIR/wasm`, else
/// `target/wasm` of this checkout).
pub fn expand(p: &Path) -> PathBuf {
    if let Ok(rest) = p.strip_prefix("$CSD_ML_HOME") {
        return csd_ml_pushdown::assets_dir().join(rest);
    }
    if let Ok(rest) = p.strip_prefix("$CSD_WASM") {
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
        return target.join("wasm").join(rest);
    }
    p.to_path_buf()
}

/// A label for a point: `link.bandwidth_mbit=100, nodes.count=2`.
pub fn label(point: &Point) -> String {
    if point.is_empty() {
        return "default".into();
    }
    point
        .iter()
        .map(|(p, v)| format!("{p}={v}"))
        .collect::<Vec<_>>()
        .join(", ")
}
