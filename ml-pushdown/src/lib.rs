//! # csd-ml-pushdown: a DNN's feature-extraction layers run next to the data
//!
//! HAPI-style transfer learning across tiers. A model is a list of stages
//! ([`model`]); a *split* `k` runs stages `[0, k)` at the storage node and the rest on
//! the compute tier, where the head is trained.
//!
//! The folders say which side of the wire code runs on:
//!
//! | where | runs on | what |
//! |---|---|---|
//! | `compute/` | the compute tier | [`job`] (a whole feature job: load a dataset, measure, plan the split, open the stream), [`stream`] (features in the training batch size, the remaining layers run here, pushed-back partitions computed here), [`planner`] (per-split epoch time from FLOPs, measured rates, load and the link), [`train`] (a linear head, AdamW) |
//! | [`node`] | the storage node | [`MlOperator`]: decode, preprocess, run the prefix with a batch size sized from the node's memory budget, stream features as Arrow (the `node` feature) |
//! | the rest | both | [`model`] (staged models on candle, per-stage FLOPs and sizes), [`preprocess`] (image decoding, resize, crop, normalisation), [`features`] (samples to tensors to feature batches), [`profile`] (what a side measures), [`dataset`] (how samples are stored), [`weights`] (weights as a table, by content), [`request`] (the `ml` operator's request and report, with limits) |
//!
//! A training loop that only reads features builds without the node
//! (`default-features = false`).

#![warn(unreachable_pub)]

mod compute;
pub mod dataset;
pub mod features;
pub mod model;
#[cfg(feature = "node")]
pub mod node;
pub mod onnx;
pub mod preprocess;
pub mod profile;
pub mod request;
pub mod weights;

pub use compute::{job, planner, stream, train};
pub use model::{Arch, StagedModel};
#[cfg(feature = "node")]
pub use node::{MlNodeOptions, MlOperator};
pub use request::FeatureRequest;

/// Errors of the ML path.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The caller asked for something malformed or impossible.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A tensor operation failed.
    #[error("tensor error: {0}")]
    Tensor(#[from] candle_core::Error),
    /// Arrow failed.
    #[error("arrow error: {0}")]
    Arrow(#[from] arrow::error::ArrowError),
    /// Parquet failed.
    #[error("parquet error: {0}")]
    Parquet(#[from] parquet::errors::ParquetError),
    /// The node said no, or the link failed.
    #[error(transparent)]
    Client(#[from] csd_protocol::node_client::Error),
    /// A node-side error.
    #[error(transparent)]
    Node(#[from] csd_protocol::Error),
}

/// Result with the ML [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// What kind of failure this is.
    pub fn status_code(&self) -> csd_protocol::StatusCode {
        use csd_protocol::StatusCode;
        match self {
            Error::InvalidArgument(_) => StatusCode::InvalidArgument,
            Error::Client(c) => c.status_code(),
            Error::Node(n) => n.status_code(),
            Error::Tensor(_) | Error::Arrow(_) | Error::Parquet(_) => {
                csd_protocol::Error::code_in(self).unwrap_or(StatusCode::Internal)
            }
        }
    }
}

/// An ML error as the node reports it: our own node errors as they are, anything
/// else kept as the cause of one of its kind.
impl From<Error> for csd_protocol::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::InvalidArgument(m) => csd_protocol::Error::InvalidArgument(m),
            Error::Node(n) => n,
            other => {
                let code = other.status_code();
                csd_protocol::Error::external(code, request::OPERATOR_NAME, other)
            }
        }
    }
}

/// An operator registry serving `ml` (add it to others with
/// [`OperatorRegistry::with`](csd_runtime::operator::OperatorRegistry::with)).
#[cfg(feature = "node")]
pub fn registry() -> csd_runtime::operator::OperatorRegistry {
    csd_runtime::operator::OperatorRegistry::new().with(std::sync::Arc::new(MlOperator::new()))
}

/// [`registry`], with the `ml` operator's settings from `config` (`[operators.ml]`,
/// `--set ml.KEY=VALUE`; see [`MlNodeOptions`]).
#[cfg(feature = "node")]
pub fn registry_with(
    config: &csd_runtime::config::NodeConfig,
) -> csd_runtime::Result<csd_runtime::operator::OperatorRegistry> {
    Ok(csd_runtime::operator::OperatorRegistry::new()
        .with(std::sync::Arc::new(MlOperator::from_config(config)?)))
}

/// A rayon pool of `threads` threads named `{name}-{i}`, each pinned to `cores` when
/// given (the node's `--cpu-set`, or an emulated compute tier's cores; with the
/// `node` feature).
pub fn thread_pool(
    name: &'static str,
    threads: usize,
    cores: Option<&[usize]>,
) -> Result<rayon::ThreadPool> {
    let cores: Option<std::sync::Arc<[usize]>> = cores.map(Into::into);
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .thread_name(move |i| format!("{name}-{i}"))
        .start_handler(move |_| {
            if let Some(c) = &cores {
                pin(c);
            }
        })
        .build()
        .map_err(|e| {
            Error::Node(csd_protocol::Error::external(
                csd_protocol::StatusCode::Internal,
                format!("{name} thread pool"),
                e,
            ))
        })
}

/// Pins the calling thread to `cores` (as the node pins its CPU pool).
#[cfg(feature = "node")]
fn pin(cores: &[usize]) {
    csd_runtime::pool::pin_current_thread(cores);
}

/// Without the node's code threads are not pinned: a program that only reads
/// features leaves placement to the OS.
#[cfg(not(feature = "node"))]
fn pin(_: &[usize]) {}

/// Where `scripts/setup-ml.sh` puts weights, sample images and its Python
/// (`$CSD_ML_HOME`, default `~/.cache/csd/ml`).
pub fn assets_dir() -> std::path::PathBuf {
    match std::env::var_os("CSD_ML_HOME") {
        Some(d) => d.into(),
        None => std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
            .join(".cache/csd/ml"),
    }
}
