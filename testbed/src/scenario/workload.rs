//! What a scenario runs: its data set ([`DataSpec`]: TPC-H or images) and its
//! workload ([`WorkloadSpec`]: SQL clients, a pipeline, a feature job).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{MAX_TIMEOUT_S, Scenario, bad};
use crate::Result;

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

fn one() -> usize {
    1
}

impl Scenario {
    /// The data's and the workload's part of [`Scenario::validate`].
    pub(super) fn validate_workload(&self) -> Result<()> {
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
        Ok(())
    }
}
