//! `csd.features` and `csd.epochs`: feature streams. The model's first layers run at the nodes (to
//! the split asked for, or the planner's), the rest here; training batches come out
//! as Arrow record batches of `id, label, features` (a fixed-size list of float32),
//! which pyarrow and NumPy read without a copy.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use arrow::record_batch::RecordBatch;
use arrow_pyarrow::PyArrowType;
use csd_client::NodeClient;
use csd_client::features::{FeaturesOptions, Model, SplitChoice};
use csd_ml_pushdown::features::{feature_schema, to_batch};
use csd_ml_pushdown::planner::Plan;
use csd_ml_pushdown::request::FeatureType;
use csd_ml_pushdown::stream::{FeatureStats, TrainBatch};
use futures::StreamExt;
use futures::stream::BoxStream;
use pyo3::prelude::*;

use crate::{creds, error, runtime};

type Batches = BoxStream<'static, csd_ml_pushdown::Result<TrainBatch>>;

/// An open feature stream: iterate it for training batches (pyarrow record
/// batches of `id`, `label`, `features`). Dropping it, or Ctrl-C while it waits,
/// stops the nodes' work.
#[pyclass(module = "csd._native")]
pub(crate) struct FeatureStream {
    batches: Arc<tokio::sync::Mutex<Option<Batches>>>,
    stats: Arc<FeatureStats>,
    /// The split run: stages (an ONNX model's cut points) `[0, split)` at the nodes.
    #[pyo3(get)]
    split: usize,
    /// Partitions read raw and run whole here.
    #[pyo3(get)]
    here: Vec<usize>,
    /// The planner's choice, when it planned (`split="auto"` or `explain=True`).
    plan: Option<Plan>,
}

#[pymethods]
impl FeatureStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<PyArrowType<RecordBatch>>> {
        let batches = self.batches.clone();
        let next = runtime::wait(py, async move {
            let mut s = batches.lock().await;
            match s.as_mut() {
                Some(s) => s.next().await,
                None => None,
            }
        });
        let next = match next {
            Ok(n) => n,
            Err(e) => {
                self.close();
                return Err(e);
            }
        };
        match next {
            None => Ok(None),
            Some(Err(e)) => {
                self.close();
                Err(error::client(e.into()))
            }
            Some(Ok(b)) => {
                let dim = b
                    .features
                    .dim(1)
                    .map_err(|e| error::client(csd_ml_pushdown::Error::from(e).into()))?;
                let schema = feature_schema(dim, FeatureType::F32);
                let batch = to_batch(&schema, &b.ids, &b.labels, &b.features, FeatureType::F32)
                    .map_err(|e| error::client(e.into()))?;
                Ok(Some(PyArrowType(batch)))
            }
        }
    }

    /// Stops the stream: the nodes' calls are cancelled.
    fn close(&self) {
        if let Ok(mut s) = self.batches.try_lock() {
            s.take();
        }
    }

    /// Bytes received from the nodes so far.
    #[getter]
    fn bytes_received(&self) -> u64 {
        self.stats.bytes_received.load(Ordering::Relaxed)
    }

    /// The planner's candidate table as text, when it planned.
    #[getter]
    fn plan(&self) -> Option<String> {
        self.plan.as_ref().map(Plan::explain)
    }

    /// The same plan as JSON: `candidates` (one object per split and share of the
    /// partitions run here, with the predicted seconds and bytes) and `best`.
    #[getter]
    fn plan_json(&self) -> PyResult<Option<String>> {
        self.plan
            .as_ref()
            .map(|p| serde_json::to_string(p).map_err(|e| error::invalid(e.to_string())))
            .transpose()
    }

    /// Partitions the nodes handed back (computed here).
    #[getter]
    fn pushed_back(&self) -> u64 {
        self.stats.pushed_back.load(Ordering::Relaxed)
    }

    /// Samples left out as undecodable (`skip_bad_samples=True`).
    #[getter]
    fn skipped(&self) -> u64 {
        self.stats.skipped.load(Ordering::Relaxed)
    }
}

/// A feature job: one model over one dataset, as many epochs as asked for. The
/// split is chosen by the first epoch (planned, with `"auto"`) and kept; with
/// `keep_seconds`, the nodes keep their output of the first epoch and later epochs
/// read it instead of running the nodes' layers again.
#[pyclass(module = "csd._native")]
pub(crate) struct FeatureJob {
    clients: Vec<NodeClient>,
    bytes: Arc<Vec<u8>>,
    opts: std::sync::Mutex<FeaturesOptions>,
    /// Plan (and explain) the next epoch: the first only.
    explain: std::sync::atomic::AtomicBool,
}

#[pymethods]
impl FeatureJob {
    /// Opens the next epoch's stream.
    fn stream(&self, py: Python<'_>) -> PyResult<FeatureStream> {
        let opts = self
            .opts
            .lock()
            .map_err(|_| error::invalid("a previous epoch failed while opening"))?
            .clone();
        let explain = self.explain.swap(false, Ordering::Relaxed);
        let (clients, bytes) = (self.clients.clone(), self.bytes.clone());
        let (batches, run) = runtime::wait(py, async move {
            Ok::<_, csd_client::Error>(
                csd_client::features::features(&clients, &bytes, &opts, explain).await?,
            )
        })?
        .map_err(error::client)?;
        // Later epochs run the split (and the share run here) the first one chose.
        if let Ok(mut o) = self.opts.lock() {
            if o.split == SplitChoice::Auto {
                o.here = Some(run.here.len());
            }
            o.split = SplitChoice::Fixed(run.split);
        }
        Ok(FeatureStream {
            batches: Arc::new(tokio::sync::Mutex::new(Some(batches))),
            stats: run.stats,
            split: run.split,
            here: run.here,
            plan: run.plan,
        })
    }

    /// The nodes' kept output, as JSON references (`csd get` reads them).
    #[getter]
    fn kept(&self) -> Vec<String> {
        let keep = self.opts.lock().ok().and_then(|o| o.keep.clone());
        keep.map(|k| {
            k.references()
                .iter()
                .filter_map(|r| serde_json::to_string(r).ok())
                .collect()
        })
        .unwrap_or_default()
    }

    /// Frees what the nodes keep for this job.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        let keep = self.opts.lock().ok().and_then(|o| o.keep.clone());
        let Some(keep) = keep else { return Ok(()) };
        runtime::wait(py, async move { keep.release().await })?.map_err(|e| error::client(e.into()))
    }
}

/// A feature job over `dataset` through `model` (a built-in architecture with its
/// `weights` file, or an ONNX model's file) split at `split` (`"auto"`, a number,
/// `"none"`, `"full"`, or an ONNX tensor's name), in training batches of
/// `batch_size`, as `csd features` runs it; `keep_seconds` keeps the nodes' output
/// between epochs for that long.
#[pyfunction]
#[pyo3(signature = (
    nodes, dataset, model, *, split = "auto".to_string(), batch_size = 64, weights = None,
    tokenizer = None, mean = None, std = None, here = None, compression = "auto".to_string(),
    skip_bad_samples = false, explain = false, keep_seconds = None, auth = None
))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn feature_job(
    py: Python<'_>,
    nodes: Vec<String>,
    dataset: String,
    model: String,
    split: String,
    batch_size: usize,
    weights: Option<PathBuf>,
    tokenizer: Option<PathBuf>,
    mean: Option<[f32; 3]>,
    std: Option<[f32; 3]>,
    here: Option<usize>,
    compression: String,
    skip_bad_samples: bool,
    explain: bool,
    keep_seconds: Option<f64>,
    auth: Option<HashMap<String, String>>,
) -> PyResult<FeatureJob> {
    if nodes.is_empty() {
        return Err(error::invalid("no storage nodes given"));
    }
    if batch_size == 0 {
        return Err(error::invalid("batch_size must be at least 1"));
    }
    let keep = match keep_seconds {
        Some(s) if !(s.is_finite() && s > 0.0) => {
            return Err(error::invalid(format!(
                "keep_seconds {s}: a positive number of seconds"
            )));
        }
        Some(s) => Some(csd_ml_pushdown::stream::KeepFeatures::new(
            std::time::Duration::from_secs_f64(s),
        )),
        None => None,
    };
    let credentials = creds::credentials(auth)?;
    let model = Model::load(&model, weights.as_deref(), tokenizer.as_deref(), mean, std)
        .map_err(error::client)?;
    let split: SplitChoice = split
        .parse()
        .map_err(|e: csd_ml_pushdown::Error| error::client(e.into()))?;
    let compression = compression
        .parse()
        .map_err(|e: csd_protocol::Error| error::client(e.into()))?;
    let opts = FeaturesOptions {
        dataset,
        arch: model.arch,
        split,
        train_batch: batch_size,
        dtype: FeatureType::F32,
        compression,
        pool: None,
        skip_bad_samples,
        keep,
        pixels: model.pixels,
        here,
    };
    let clients = runtime::wait(py, async move {
        let mut clients = Vec::new();
        for n in &nodes {
            clients.push(NodeClient::connect_with(n, &credentials).await?);
        }
        Ok::<_, csd_client::Error>(clients)
    })?
    .map_err(error::client)?;
    Ok(FeatureJob {
        clients,
        bytes: Arc::new(model.bytes),
        opts: std::sync::Mutex::new(opts),
        explain: std::sync::atomic::AtomicBool::new(explain),
    })
}
