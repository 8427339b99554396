//! # csd-ml-pushdown: a DNN's feature-extraction layers run next to the data
//!
//! HAPI-style transfer learning across tiers. A model is a list of stages
//! ([`model`]); a *split* `k` runs stages `[0, k)` at the storage node and the rest on
//! the compute tier, where the head is trained.
//!
//! * [`model`]: staged models on candle (EfficientNet-Lite0), per-stage FLOPs, output
//!   and activation sizes.
//! * [`preprocess`]: JPEG/PNG decoding, resize, center crop, normalisation.
//! * [`dataset`]: how samples are stored at a node (a table of `id, label, data`).
//! * [`weights`]: model weights stored at the node as a table, addressed by content.
//! * [`request`]: the `ml` operator's request, with limits.
//! * [`node`]: [`MlOperator`], the storage side: decode, preprocess, run the prefix
//!   with a batch size sized from the node's memory budget, stream features as Arrow.
//! * [`planner`]: per-split predicted epoch time from FLOPs, measured rates, load and
//!   link bandwidth; picks the least.
//! * [`train`]: a linear head trained on streamed features (AdamW).
//! * [`job`]: a whole feature job from the compute tier: load a dataset, measure,
//!   plan the split, open the stream (the `csd` CLI and the testbed use it).
//! * [`stream`]: the compute side: a feature stream in the training batch size, with
//!   the remaining layers run here and pushed-back partitions computed here.

#![warn(unreachable_pub)]

pub mod dataset;
pub mod job;
pub mod model;
pub mod node;
pub mod planner;
pub mod preprocess;
pub mod request;
pub mod stream;
pub mod train;
pub mod weights;

pub use model::{Arch, StagedModel};
pub use node::MlOperator;
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
    Client(#[from] csd_runtime::node_client::Error),
    /// A node-side error.
    #[error(transparent)]
    Node(#[from] csd_runtime::Error),
}

/// Result with the ML [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// What kind of failure this is.
    pub fn status_code(&self) -> csd_runtime::StatusCode {
        use csd_runtime::StatusCode;
        match self {
            Error::InvalidArgument(_) => StatusCode::InvalidArgument,
            Error::Client(c) => c.status_code(),
            Error::Node(n) => n.status_code(),
            Error::Tensor(_) | Error::Arrow(_) | Error::Parquet(_) => {
                csd_runtime::Error::code_in(self).unwrap_or(StatusCode::Internal)
            }
        }
    }
}

/// An ML error as the node reports it: our own node errors as they are, anything
/// else kept as the cause of one of its kind.
impl From<Error> for csd_runtime::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::InvalidArgument(m) => csd_runtime::Error::InvalidArgument(m),
            Error::Node(n) => n,
            other => {
                let code = other.status_code();
                csd_runtime::Error::external(code, "ml", other)
            }
        }
    }
}

/// An operator registry serving `ml` (add it to others with
/// [`OperatorRegistry::with`](csd_runtime::operator::OperatorRegistry::with)).
pub fn registry() -> csd_runtime::operator::OperatorRegistry {
    csd_runtime::operator::OperatorRegistry::new().with(std::sync::Arc::new(MlOperator::new()))
}

/// A rayon pool of `threads` threads named `{name}-{i}`, each pinned to `cores` when
/// given (the node's `--cpu-set`, or an emulated compute tier's cores).
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
                csd_runtime::pool::pin_current_thread(c);
            }
        })
        .build()
        .map_err(|e| {
            Error::Node(csd_runtime::Error::Internal(format!(
                "{name} thread pool: {e}"
            )))
        })
}

/// Where `scripts/setup-ml.sh` puts weights, sample images and its Python
/// (`$CSD_ML_HOME`, default `~/.cache/csd/ml`).
pub fn assets_dir() -> std::path::PathBuf {
    match std::env::var_os("CSD_ML_HOME") {
        Some(d) => d.into(),
        None => std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
            .join(".cache/csd/ml"),
    }
}
