//! Scenario files: the cluster, the data, the workload, the policies to compare and
//! the parameters to sweep, in TOML.
//!
//! Parsing rejects unknown keys and wrong types with the TOML parser's message (line,
//! column, key, what was expected); [`Scenario::validate`] then checks ranges and
//! combinations and names the field (`nodes.count: expected 1 to 16, got 0`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

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

/// Storage nodes, all alike.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodesSpec {
    /// How many.
    pub count: usize,
    /// CPU workers for pushed-down work, per node.
    #[serde(default = "one")]
    pub cpus: usize,
    /// Memory budget per node (`1GiB`).
    #[serde(default = "default_memory")]
    pub memory: String,
    /// Emulated device capacity per node (`2GiB`).
    #[serde(default = "default_capacity")]
    pub capacity: String,
    /// Admission control's queueing-delay target, milliseconds.
    #[serde(default = "default_queue_target")]
    pub queue_target_ms: f64,
    /// The emulated NVMe device.
    #[serde(default)]
    pub device: DeviceConf,
    /// Give every node its own cores (node `i` gets the `i`-th run of `cpus` cores)
    /// and the compute node's ML work the cores left over, so that a node and the
    /// compute tier do not share cores the way separate machines would not. Needs
    /// `count × cpus` + 1 cores. (The compute tier's SQL runs on the async runtime and
    /// stays unpinned.)
    #[serde(default)]
    pub pin: bool,
    /// TLS on every node and a tenant's token on every request (a private CA and a
    /// tenants file made for the run): what security costs, measured.
    #[serde(default)]
    pub secure: bool,
}

fn one() -> usize {
    1
}
fn default_memory() -> String {
    "1GiB".into()
}
fn default_capacity() -> String {
    "2GiB".into()
}
fn default_queue_target() -> f64 {
    50.0
}

/// Which cores each node and the compute tier run on (`nodes.pin`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct CorePlan {
    /// Per node.
    pub nodes: Vec<Vec<usize>>,
    /// The compute tier's ML work.
    pub compute: Vec<usize>,
}

/// Emulated NVMe timing (see `csd_runtime::device::emulated::TimingModel`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeviceConf {
    /// Per-command latency, microseconds.
    pub latency_us: f64,
    /// Read bandwidth, MB/s.
    pub read_mbps: f64,
    /// Write bandwidth, MB/s.
    pub write_mbps: f64,
    /// Commands the device accepts at once.
    pub queue_depth: usize,
    /// Commands it works on in parallel.
    pub parallelism: usize,
}

impl Default for DeviceConf {
    /// A datacenter NVMe drive, roughly.
    fn default() -> Self {
        DeviceConf {
            latency_us: 80.0,
            read_mbps: 3000.0,
            write_mbps: 1500.0,
            queue_depth: 64,
            parallelism: 8,
        }
    }
}

/// The compute node.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComputeSpec {
    /// DataFusion partitions (default: this machine's cores).
    #[serde(default)]
    pub partitions: Option<usize>,
    /// datafusion-distributed workers (`csd worker`, in-process, serving gRPC on
    /// 127.0.0.1) that run the pushdown policies' stages; 0: the session runs them.
    /// They reach the nodes through the same links. The `none` policy always runs
    /// in the session.
    #[serde(default)]
    pub workers: usize,
}

/// One link's bandwidth and latency (each direction).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LinkConf {
    /// Megabits per second; 0 = not throttled.
    pub bandwidth_mbit: f64,
    /// One-way latency, microseconds.
    pub latency_us: f64,
}

impl Default for LinkConf {
    fn default() -> Self {
        LinkConf {
            bandwidth_mbit: 1000.0,
            latency_us: 100.0,
        }
    }
}

/// The data set.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum DataSpec {
    /// TPC-H generated in-process.
    Tpch {
        /// Scale factor (1 ≈ 1 GB of CSV, 6 M lineitems).
        scale: f64,
        /// Partitions per table in all, spread round-robin over the nodes (default:
        /// 2 per node). Fix it to keep the data the same across a node-count sweep.
        #[serde(default)]
        partitions: Option<usize>,
    },
    /// An image folder (class per subfolder, or a labels CSV).
    Images {
        /// The folder; default: the textures `scripts/setup-ml.sh` cuts
        /// (`$CSD_ML_HOME/textures/train`). Relative paths are against the scenario
        /// file's folder; a leading `$CSD_ML_HOME` is the ML assets folder.
        #[serde(default)]
        dir: Option<PathBuf>,
        /// `file,class` CSV instead of subfolders.
        #[serde(default)]
        labels: Option<PathBuf>,
        /// Store every image this many times (a longer epoch from a small folder).
        #[serde(default = "one")]
        repeat: usize,
        /// Partitions in all (default: 2 per node).
        #[serde(default)]
        partitions: Option<usize>,
        /// Model.
        #[serde(default = "default_model")]
        model: String,
        /// Weights (default: `$CSD_ML_HOME/<model>.safetensors`).
        #[serde(default)]
        weights: Option<PathBuf>,
    },
}

fn default_model() -> String {
    "efficientnet-lite0".into()
}

/// A query: a TPC-H number or SQL text.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum QueryRef {
    /// TPC-H query 1–22.
    Tpch(u32),
    /// SQL text; `{selectivity}` is replaced by `workload.selectivity`.
    Sql(String),
}

/// The workload.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum WorkloadSpec {
    /// SQL queries from concurrent clients.
    Sql {
        /// The mix, cycled.
        queries: Vec<QueryRef>,
        /// Closed-loop clients (each runs the mix, one query at a time). Ignored
        /// when an arrival rate is given.
        #[serde(default = "one")]
        clients: usize,
        /// Open loop: Poisson arrivals at this many queries per second.
        #[serde(default)]
        rate_qps: Option<f64>,
        /// Open loop at this multiple of the cluster's measured capacity (nodes ×
        /// CPUs ÷ mean unloaded latency with pushdown).
        #[serde(default)]
        load: Option<f64>,
        /// Offer work for this long (seconds).
        #[serde(default)]
        duration_s: Option<f64>,
        /// Closed loop: each client runs the mix this many times (default 1 when
        /// no duration is given).
        #[serde(default)]
        repetitions: Option<usize>,
        /// Replaces `{selectivity}` in SQL text (0–1).
        #[serde(default)]
        selectivity: Option<f64>,
        /// Wasm SQL functions the queries call, registered on every session.
        #[serde(default)]
        wasm_functions: Vec<WasmFunctionSpec>,
    },
    /// A pipeline of SQL steps over TPC-H data, each reading the previous step's
    /// answer (`{input}` in its text): policies `kept` (each step's answer kept at
    /// the nodes) and `shipped` (brought back and sent again).
    Pipeline {
        /// The steps, in order; every step after the first names `{input}`.
        steps: Vec<String>,
        /// Pipelines per run.
        #[serde(default = "one")]
        repetitions: usize,
    },
    /// A feature-extraction job (one epoch over the data set per run).
    Features {
        /// Training batch size.
        #[serde(default = "default_batch")]
        batch: usize,
        /// Ship features as f16.
        #[serde(default)]
        f16: bool,
        /// Epochs per run.
        #[serde(default = "one")]
        epochs: usize,
    },
}

/// A Wasm SQL function (`csd sql --wasm-fn NAME=MODULE:EXPORT`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WasmFunctionSpec {
    /// The SQL name.
    pub name: String,
    /// The module: relative to the scenario file's folder; a leading `$CSD_WASM` is
    /// where `scripts/build-wasm-examples.sh` puts the example guests.
    pub module: PathBuf,
    /// Its export (default: the name).
    #[serde(default)]
    pub export: Option<String>,
}

fn default_batch() -> usize {
    64
}

/// A policy to compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyName {
    /// SQL: read Parquet ranges, evaluate everything at the compute node.
    None,
    /// SQL: push down; nodes run everything (queueing, never pushing back).
    /// Features: every feature stage at the node.
    Full,
    /// SQL: push down; nodes admit what they have room for and push the rest back.
    Adaptive,
    /// Features: ship raw samples, run the whole model here.
    ComputeOnly,
    /// Features: the planner's split.
    Auto,
    /// Features: stages `[0, k)` at the node.
    Split(usize),
    /// Pipelines: each step's answer kept at the nodes, read there by the next.
    Kept,
    /// Pipelines: each step's answer brought back and sent to a node again.
    Shipped,
}

impl PolicyName {
    /// Whether it applies to SQL workloads (else to feature jobs). `full` is both.
    pub fn sql(self) -> bool {
        matches!(
            self,
            PolicyName::None | PolicyName::Full | PolicyName::Adaptive
        )
    }
    /// Whether it applies to pipelines.
    pub fn pipeline(self) -> bool {
        matches!(self, PolicyName::Kept | PolicyName::Shipped)
    }
    /// Whether it applies to feature jobs.
    pub fn features(self) -> bool {
        matches!(
            self,
            PolicyName::Full | PolicyName::ComputeOnly | PolicyName::Auto | PolicyName::Split(_)
        )
    }
}

impl std::fmt::Display for PolicyName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PolicyName::None => f.write_str("none"),
            PolicyName::Full => f.write_str("full"),
            PolicyName::Adaptive => f.write_str("adaptive"),
            PolicyName::ComputeOnly => f.write_str("compute-only"),
            PolicyName::Auto => f.write_str("auto"),
            PolicyName::Split(k) => write!(f, "split:{k}"),
            PolicyName::Kept => f.write_str("kept"),
            PolicyName::Shipped => f.write_str("shipped"),
        }
    }
}

impl std::str::FromStr for PolicyName {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Ok(match s {
            "none" => PolicyName::None,
            "full" => PolicyName::Full,
            "adaptive" => PolicyName::Adaptive,
            "compute-only" => PolicyName::ComputeOnly,
            "auto" => PolicyName::Auto,
            "kept" => PolicyName::Kept,
            "shipped" => PolicyName::Shipped,
            other => match other.strip_prefix("split:").map(str::parse) {
                Some(Ok(k)) => PolicyName::Split(k),
                _ => {
                    return Err(format!(
                        "unknown policy {other:?}: expected none, full, adaptive (SQL), compute-only, full, auto, split:N (features) or kept, shipped (pipelines)"
                    ));
                }
            },
        })
    }
}

impl Serialize for PolicyName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PolicyName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

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

fn bad(field: &str, why: impl std::fmt::Display) -> Error {
    Error::Scenario(format!("{field}: {why}"))
}

/// The message of a scenario error, without the "bad scenario" prefix.
fn inner(e: Error) -> String {
    match e {
        Error::Scenario(m) => m,
        other => other.to_string(),
    }
}

fn whole(field: &str, v: f64, lo: usize, hi: usize) -> Result<usize> {
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
        let n = &self.nodes;
        if n.count == 0 || n.count > MAX_NODES {
            return Err(bad(
                "nodes.count",
                format!("expected 1 to {MAX_NODES}, got {}", n.count),
            ));
        }
        if n.cpus == 0 || n.cpus > 64 {
            return Err(bad(
                "nodes.cpus",
                format!("expected 1 to 64, got {}", n.cpus),
            ));
        }
        for (field, v) in [("nodes.memory", &n.memory), ("nodes.capacity", &n.capacity)] {
            csd_runtime::device::parse_size(v)
                .map_err(|_| bad(field, format!("expected a size such as 1GiB, got {v:?}")))?;
        }
        if !(n.queue_target_ms.is_finite() && n.queue_target_ms >= 0.0) {
            return Err(bad(
                "nodes.queue_target_ms",
                "expected a non-negative number",
            ));
        }
        if self.compute.workers > MAX_WORKERS {
            return Err(bad(
                "compute.workers",
                format!("expected 0 to {MAX_WORKERS}, got {}", self.compute.workers),
            ));
        }
        self.device_spec()?;
        for (i, l) in std::iter::once(&self.link).chain(&self.links).enumerate() {
            let field = if i == 0 {
                "link".to_string()
            } else {
                format!("links[{}]", i - 1)
            };
            if !(l.bandwidth_mbit.is_finite() && l.bandwidth_mbit >= 0.0) {
                return Err(bad(
                    &format!("{field}.bandwidth_mbit"),
                    "expected megabits per second ≥ 0 (0: not throttled)",
                ));
            }
            if !(l.latency_us.is_finite() && (0.0..=10e6).contains(&l.latency_us)) {
                return Err(bad(
                    &format!("{field}.latency_us"),
                    "expected microseconds from 0 to 10,000,000",
                ));
            }
        }
        if self.links.len() > n.count && self.sweep.iter().all(|a| a.parameter != "nodes.count") {
            return Err(bad(
                "links",
                format!("{} entries for {} nodes", self.links.len(), n.count),
            ));
        }
        match &self.data {
            DataSpec::Tpch { scale, partitions } => {
                if !(scale.is_finite() && *scale > 0.0 && *scale <= 100.0) {
                    return Err(bad(
                        "data.scale",
                        format!("expected 0 < scale ≤ 100, got {scale}"),
                    ));
                }
                if partitions.is_some_and(|p| p == 0 || p > 1024) {
                    return Err(bad("data.partitions", "expected 1 to 1024"));
                }
                if matches!(self.workload, WorkloadSpec::Features { .. }) {
                    return Err(bad(
                        "workload.kind",
                        "TPC-H data needs kind = \"sql\" or \"pipeline\"",
                    ));
                }
            }
            DataSpec::Images {
                repeat,
                partitions,
                model,
                ..
            } => {
                if *repeat == 0 || *repeat > 10_000 {
                    return Err(bad("data.repeat", "expected 1 to 10000"));
                }
                if partitions.is_some_and(|p| p == 0 || p > 1024) {
                    return Err(bad("data.partitions", "expected 1 to 1024"));
                }
                model
                    .parse::<csd_ml_pushdown::Arch>()
                    .map_err(|e| bad("data.model", e))?;
                if !matches!(self.workload, WorkloadSpec::Features { .. }) {
                    return Err(bad("workload.kind", "image data needs kind = \"features\""));
                }
            }
        }
        match &self.workload {
            WorkloadSpec::Sql {
                queries,
                clients,
                rate_qps,
                load,
                duration_s,
                repetitions,
                selectivity,
                wasm_functions,
            } => {
                if queries.is_empty() {
                    return Err(bad("workload.queries", "expected at least one query"));
                }
                for (i, f) in wasm_functions.iter().enumerate() {
                    csd_query_pushdown::wire::shipped::check_function_name(&f.name)
                        .map_err(|e| bad("workload.wasm_functions", e.to_string()))?;
                    if wasm_functions[..i].iter().any(|g| g.name == f.name) {
                        return Err(bad(
                            "workload.wasm_functions",
                            format!("{} is registered twice", f.name),
                        ));
                    }
                }
                for q in queries {
                    match q {
                        QueryRef::Tpch(n) if !(1..=22).contains(n) => {
                            return Err(bad(
                                "workload.queries",
                                format!("TPC-H has queries 1 to 22, not {n}"),
                            ));
                        }
                        QueryRef::Sql(s)
                            if s.contains("{selectivity}")
                                && selectivity.is_none()
                                && !self
                                    .sweep
                                    .iter()
                                    .any(|a| a.parameter == "workload.selectivity") =>
                        {
                            return Err(bad(
                                "workload.selectivity",
                                "a query uses {selectivity} but no value or sweep gives it",
                            ));
                        }
                        _ => {}
                    }
                }
                if *clients == 0 || *clients > 256 {
                    return Err(bad(
                        "workload.clients",
                        format!("expected 1 to 256, got {clients}"),
                    ));
                }
                if rate_qps.is_some() && load.is_some() {
                    return Err(bad("workload.load", "give rate_qps or load, not both"));
                }
                for (f, v) in [("workload.rate_qps", rate_qps), ("workload.load", load)] {
                    if v.is_some_and(|v| !(v.is_finite() && v > 0.0 && v <= 10_000.0)) {
                        return Err(bad(f, "expected a positive number up to 10000"));
                    }
                }
                let open = rate_qps.is_some()
                    || load.is_some()
                    || self.sweep.iter().any(|a| {
                        matches!(a.parameter.as_str(), "workload.load" | "workload.rate_qps")
                    });
                if open && duration_s.is_none() {
                    return Err(bad(
                        "workload.duration_s",
                        "an open-loop workload (rate_qps or load) needs a duration",
                    ));
                }
                if duration_s.is_some_and(|d| !(d.is_finite() && d > 0.0 && d <= MAX_TIMEOUT_S)) {
                    return Err(bad(
                        "workload.duration_s",
                        format!("expected 0 < seconds ≤ {MAX_TIMEOUT_S}"),
                    ));
                }
                if repetitions.is_some_and(|r| r == 0 || r > 100_000) {
                    return Err(bad("workload.repetitions", "expected 1 to 100000"));
                }
                if selectivity.is_some_and(|s| !(0.0..=1.0).contains(&s)) {
                    return Err(bad("workload.selectivity", "expected 0 to 1"));
                }
            }
            WorkloadSpec::Pipeline { steps, repetitions } => {
                if steps.len() < 2 {
                    return Err(bad("workload.steps", "expected at least two steps"));
                }
                if let Some(i) = steps.iter().skip(1).position(|s| !s.contains("{input}")) {
                    return Err(bad(
                        "workload.steps",
                        format!(
                            "step {} does not read the previous step's answer: name it {{input}}",
                            i + 2
                        ),
                    ));
                }
                if *repetitions == 0 || *repetitions > 10_000 {
                    return Err(bad("workload.repetitions", "expected 1 to 10000"));
                }
            }
            WorkloadSpec::Features { batch, epochs, .. } => {
                if *batch == 0 || *batch > 4096 {
                    return Err(bad("workload.batch", "expected 1 to 4096"));
                }
                if *epochs == 0 || *epochs > 100 {
                    return Err(bad("workload.epochs", "expected 1 to 100"));
                }
            }
        }
        if self.policies.is_empty() {
            return Err(bad("policies", "expected at least one policy"));
        }
        let sql = matches!(self.workload, WorkloadSpec::Sql { .. });
        let pipeline = matches!(self.workload, WorkloadSpec::Pipeline { .. });
        for p in &self.policies {
            if pipeline {
                if !p.pipeline() {
                    return Err(bad(
                        "policies",
                        format!("{p} does not apply to pipelines; they take kept, shipped"),
                    ));
                }
                continue;
            }
            if p.pipeline() {
                return Err(bad(
                    "policies",
                    format!("{p} is a pipeline policy (workload.kind = \"pipeline\")"),
                ));
            }
            if sql && !p.sql() {
                return Err(bad(
                    "policies",
                    format!("{p} is a feature-job policy; SQL takes none, full, adaptive"),
                ));
            }
            if !sql && !p.features() {
                return Err(bad(
                    "policies",
                    format!(
                        "{p} is a SQL policy; feature jobs take compute-only, full, auto, split:N"
                    ),
                ));
            }
        }
        if let Some(b) = self.baseline
            && !self.policies.contains(&b)
        {
            return Err(bad("baseline", format!("{b} is not among the policies")));
        }
        if !(self.timeout_s.is_finite() && self.timeout_s > 0.0 && self.timeout_s <= MAX_TIMEOUT_S)
        {
            return Err(bad(
                "timeout_s",
                format!("expected 0 < seconds ≤ {MAX_TIMEOUT_S}"),
            ));
        }
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

    /// With `nodes.pin`: each node's cores and the compute tier's, out of `available`.
    pub(crate) fn core_plan(&self, available: &[usize]) -> Result<Option<CorePlan>> {
        if !self.nodes.pin {
            return Ok(None);
        }
        let need = self.nodes.count * self.nodes.cpus;
        if need >= available.len() {
            return Err(bad(
                "nodes.pin",
                format!(
                    "{} node(s) × {} cpus need {need} cores, plus at least one for the compute \
                     node; this machine lets us use {} ({available:?})",
                    self.nodes.count,
                    self.nodes.cpus,
                    available.len()
                ),
            ));
        }
        Ok(Some(CorePlan {
            nodes: available[..need]
                .chunks(self.nodes.cpus)
                .map(<[usize]>::to_vec)
                .collect(),
            compute: available[need..].to_vec(),
        }))
    }

    /// The device spec every node gets (`emulated:mem,...`).
    pub(crate) fn device_spec(&self) -> Result<String> {
        let d = &self.nodes.device;
        let spec = format!(
            "emulated:mem,latency_us={},read_mbps={},write_mbps={},queue_depth={},parallelism={}",
            d.latency_us, d.read_mbps, d.write_mbps, d.queue_depth, d.parallelism
        );
        spec.parse::<csd_runtime::device::DeviceSpec>()
            .map_err(|e| bad("nodes.device", e))?;
        Ok(spec)
    }

    /// Sets a sweepable parameter, checking the result.
    pub fn set(&mut self, parameter: &str, v: f64) -> Result<()> {
        self.set_raw(parameter, v)?;
        self.validate()
    }

    fn set_raw(&mut self, parameter: &str, v: f64) -> Result<()> {
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
            "nodes.cpus" => self.nodes.cpus = whole(parameter, v, 1, 64)?,
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

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
name = "t"
policies = ["none", "adaptive"]
[nodes]
count = 2
[data]
kind = "tpch"
scale = 0.01
[workload]
kind = "sql"
queries = [1, 6]
"#;

    fn err(text: &str) -> String {
        Scenario::parse(text)
            .expect_err("should be refused")
            .to_string()
    }

    #[test]
    fn pinning_gives_nodes_their_own_cores_and_compute_the_rest() {
        let mut s = Scenario::parse(BASE).expect("valid");
        assert_eq!(
            s.core_plan(&[0, 1, 2]).unwrap(),
            None,
            "pin is off by default"
        );
        s.nodes.pin = true;
        let plan = s.core_plan(&[0, 1, 2, 3, 5]).unwrap().unwrap();
        assert_eq!(plan.nodes, vec![vec![0], vec![1]]);
        assert_eq!(plan.compute, vec![2, 3, 5]);
        s.nodes.cpus = 2;
        let e = s.core_plan(&[0, 1, 2, 3]).unwrap_err().to_string();
        assert!(e.contains("nodes.pin") && e.contains("need 4 cores"), "{e}");
    }

    #[test]
    fn parses_defaults_and_points() {
        let mut s = Scenario::parse(BASE).expect("valid");
        assert_eq!(s.nodes.cpus, 1);
        assert_eq!(s.partitions(), 4);
        assert_eq!(s.baseline(), PolicyName::None);
        assert_eq!(s.points(), vec![Vec::<(String, f64)>::new()]);
        s.sweep = vec![
            SweepAxis {
                parameter: "link.bandwidth_mbit".into(),
                values: vec![100.0, 1000.0],
            },
            SweepAxis {
                parameter: "nodes.count".into(),
                values: vec![1.0, 2.0, 4.0],
            },
        ];
        s.validate().expect("valid sweep");
        let pts = s.points();
        assert_eq!(pts.len(), 6);
        let at = s.at(&pts[5]).expect("point");
        assert_eq!(at.nodes.count, 4);
        assert_eq!(at.link.bandwidth_mbit, 1000.0);
    }

    #[test]
    fn errors_name_the_field() {
        let e = err(&BASE.replace("count = 2", "count = 0"));
        assert!(
            e.contains("nodes.count") && e.contains("expected 1 to 16"),
            "{e}"
        );
        let e = err(&BASE.replace("count = 2", "count = 2\ncpu = 3"));
        assert!(
            e.contains("unknown field `cpu`") && e.contains("cpus"),
            "{e}"
        );
        let e = err(&BASE.replace("count = 2", "count = \"two\""));
        assert!(
            e.contains("count = \"two\"") && e.contains("expected usize"),
            "{e}"
        );
        let e = err(&BASE.replace("[1, 6]", "[1, 23]"));
        assert!(e.contains("workload.queries") && e.contains("23"), "{e}");
        let e = err(&BASE.replace("\"adaptive\"", "\"auto\""));
        assert!(e.contains("policies") && e.contains("auto"), "{e}");
        let e = err(&BASE.replace("\"adaptive\"", "\"sometimes\""));
        assert!(
            e.contains("unknown policy") && e.contains("sometimes"),
            "{e}"
        );
        let e = err(&format!(
            "{BASE}[[sweep]]\nparameter = \"nodes.colour\"\nvalues = [1]\n"
        ));
        assert!(
            e.contains("sweep[0].parameter") && e.contains("link.bandwidth_mbit"),
            "{e}"
        );
        let e = err(&format!(
            "{BASE}[[sweep]]\nparameter = \"nodes.count\"\nvalues = [1, 2.5]\n"
        ));
        assert!(
            e.contains("sweep[0].values") && e.contains("whole number"),
            "{e}"
        );
        let e = err(&BASE.replace("queries = [1, 6]", "queries = [1]\nload = 2"));
        assert!(e.contains("workload.duration_s"), "{e}");
        let e = err(&BASE.replace("scale = 0.01", "scale = 0.01\nkind2 = 1"));
        assert!(e.contains("kind2"), "{e}");
        let e = err(&BASE.replace("\"sql\"", "\"features\""));
        assert!(e.contains("workload"), "{e}");
        let e = err(&BASE.replace("[nodes]", "[nodes]\nmemory = \"lots\""));
        assert!(e.contains("nodes.memory") && e.contains("lots"), "{e}");
    }

    #[test]
    fn shrink_keeps_it_valid() {
        let mut s = Scenario::parse(&format!(
            "{BASE}[[sweep]]\nparameter = \"link.bandwidth_mbit\"\nvalues = [100, 300, 1000, 10000]\n"
        ))
        .expect("valid");
        s.shrink();
        s.validate().expect("still valid");
        assert_eq!(s.sweep[0].values, vec![100.0, 10000.0]);
    }
}
