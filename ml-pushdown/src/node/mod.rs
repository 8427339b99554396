//! The storage side: the `ml` operator.
//!
//! For a [`FeatureRequest`] it reads the dataset partition, decodes and preprocesses
//! each sample, runs stages `[0, split)` and streams `id, label, features` where
//! `features` is a `FixedSizeList<Float32|Float16>` of the stage's output, flattened.
//!
//! **Memory.** The node batch size is chosen before anything runs, from the node's
//! memory budget and the model's per-stage activation sizes, and is independent of the
//! training batch size: `fixed + batch × per_sample ≤ budget / 2`, where `fixed` is the
//! weights (twice: the file and the tensors while loading) plus a decode reserve per
//! worker, and `per_sample` the largest activation footprint of the prefix plus the
//! input and output tensors. The estimate hands admission control exactly that figure,
//! so a request whose single sample cannot fit is pushed back, never run. The estimate
//! reads and loads nothing: an ONNX model's stages are known only once it is loaded,
//! so until then its estimate is the ceiling, half the budget; it is loaded once
//! admitted, and one whose batch of one needs more is handed back then.
//!
//! **CPU.** Decoding and layers run on a rayon pool with as many threads as the node
//! has CPUs (`--cpus`), so candle's matrix products never use cores outside the budget;
//! with `--cpu-set` its threads are pinned to the same cores as the node's CPU pool.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use arrow::record_batch::RecordBatch;
use async_trait::async_trait;
use bytes::Bytes;
use candle_core::Device;
use csd_runtime::memory::MemoryLedger;
use csd_runtime::operator::{Estimate, Operator, OperatorContext, OperatorRequest, OperatorStream};
use csd_runtime::table::{ObjectReader, ParquetObject};
use futures::{StreamExt, TryStreamExt};
use parquet::arrow::ParquetRecordBatchStreamBuilder;
use serde::{Deserialize, Serialize};

use crate::dataset::{self, Samples};
use crate::features::{
    blocking, decodable, feature_schema, forward_range_chunked, profile, to_batch,
};
use crate::model::{Arch, OnnxModelStages, PixelNorm, StageInfo, StagedModel};
use crate::profile::ProfileCache;
use crate::request::{
    DEFAULT_NODE_BATCH, FeatureRequest, MAX_NODE_BATCH, MlDetails, Mode, OPERATOR_NAME,
    PROFILE_BATCH, PROFILE_SAMPLES,
};
use crate::{Error, Result};

/// Memory held back per worker for decoding one image (see
/// [`preprocess::MAX_IMAGE_ALLOC`]).
pub(crate) const DECODE_RESERVE: u64 = 32 << 20;

/// The `ml` operator's settings at a node: `[operators.ml]` in its settings file,
/// or `csd serve --set ml.KEY=VALUE`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MlNodeOptions {
    /// Loaded models kept (each holds its weights, and an ONNX model an
    /// onnxruntime session); the least recently used goes.
    pub cached_models: usize,
}

impl Default for MlNodeOptions {
    fn default() -> Self {
        MlNodeOptions { cached_models: 4 }
    }
}

/// The node batch size and the memory it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct BatchPlan {
    /// Samples per node batch.
    pub batch: usize,
    /// Bytes reserved with admission control.
    pub memory: u64,
    /// Bytes per sample in flight.
    pub per_sample: u64,
}

/// Sizes the node batch: the most samples (≤ `cap`) such that the request fits in half
/// the node's memory budget; never fewer than one.
pub(crate) fn batch_plan(
    stages: &[StageInfo],
    input_shape: &[usize],
    split: usize,
    weights_len: u64,
    threads: usize,
    budget: u64,
    cap: usize,
) -> BatchPlan {
    let input = input_shape.iter().product::<usize>() as u64 * 4;
    let split = split.min(stages.len());
    let peak = stages[..split]
        .iter()
        .map(|s| s.peak_bytes)
        .max()
        .unwrap_or(0);
    let out = if split == 0 {
        input
    } else {
        stages[split - 1].out_bytes()
    };
    // The input tensor, the prefix's worst stage, and the output twice (tensor and
    // Arrow array).
    let per_sample = input + peak + 2 * out;
    let fixed = 2 * weights_len + threads as u64 * DECODE_RESERVE + (8 << 20);
    let room = (budget / 2).saturating_sub(fixed);
    let batch = ((room / per_sample.max(1)) as usize).clamp(1, cap.clamp(1, MAX_NODE_BATCH));
    BatchPlan {
        batch,
        memory: fixed + batch as u64 * per_sample,
        per_sample,
    }
}

/// The `ml` operator.
#[derive(Default)]
pub struct MlOperator {
    options: MlNodeOptions,
    models: Mutex<VecDeque<(String, Arc<dyn StagedModel>)>>,
    loading: tokio::sync::Mutex<()>,
    pool: OnceLock<Arc<rayon::ThreadPool>>,
    memory_used: Arc<AtomicU64>,
    /// Profiles measured lately, by [`profile_key`].
    profiles: ProfileCache,
}

/// What a profile depends on: the partition's objects (ids change when replaced), the
/// model and weights, and the pool's threads.
fn profile_key(
    r: &FeatureRequest,
    engine: &str,
    objects: &[ParquetObject],
    threads: usize,
) -> String {
    let ids: Vec<String> = objects.iter().map(|o| o.object.id.to_string()).collect();
    format!(
        "{}/{}/{}:{engine}/{}/{threads}/{}",
        r.dataset,
        r.partition,
        r.model,
        r.weights,
        ids.join(",")
    )
}

/// A request's batch plan's memory, counted in the operator's figure and in the
/// node's memory ledger (as operators' pooled memory, beside the SQL operator's
/// pools) while the request runs: one account of `--memory`.
struct MemoryGuard {
    used: Arc<AtomicU64>,
    ledger: Arc<MemoryLedger>,
    bytes: u64,
}

impl MemoryGuard {
    /// Counts `bytes` in `used` and `ledger` until dropped. Admission has already
    /// reserved them, so the ledger takes them whether or not its pools have room.
    fn new(used: Arc<AtomicU64>, ledger: Arc<MemoryLedger>, bytes: u64) -> Self {
        used.fetch_add(bytes, Ordering::Relaxed);
        ledger.take(bytes);
        MemoryGuard {
            used,
            ledger,
            bytes,
        }
    }
}

impl Drop for MemoryGuard {
    fn drop(&mut self) {
        self.used.fetch_sub(self.bytes, Ordering::Relaxed);
        self.ledger.give_back(self.bytes);
    }
}

/// What a loaded model is kept under.
fn model_key(arch: Arch, weights: &str, pixels: Option<PixelNorm>) -> String {
    format!("{arch}/{weights}/{pixels:?}")
}

/// The weights' length, from their content-addressed table name.
fn weights_len(table: &str) -> Result<u64> {
    table
        .rsplit('_')
        .next()
        .and_then(|h| u64::from_str_radix(h, 16).ok())
        .ok_or_else(|| Error::InvalidArgument(format!("{table:?} is not a weights table name")))
}

impl MlOperator {
    /// A new operator with default settings (models load on first use).
    pub fn new() -> Self {
        Self::default()
    }

    /// The operator with `options`.
    pub fn with_options(options: MlNodeOptions) -> Self {
        MlOperator {
            options,
            ..Self::default()
        }
    }

    /// The operator with a node's settings (`[operators.ml]`, `--set ml.KEY=VALUE`);
    /// a bad or unknown key is an error naming it.
    pub fn from_config(config: &csd_runtime::config::NodeConfig) -> csd_runtime::Result<Self> {
        Ok(Self::with_options(config.operator_options(OPERATOR_NAME)?))
    }

    fn pool(&self, threads: usize, cores: Option<&[usize]>) -> Result<Arc<rayon::ThreadPool>> {
        if let Some(p) = self.pool.get() {
            return Ok(p.clone());
        }
        let p = crate::thread_pool("csd-ml", threads, cores)?;
        Ok(self.pool.get_or_init(|| Arc::new(p)).clone())
    }

    /// The model, if it is loaded here already.
    fn loaded(
        &self,
        arch: Arch,
        weights: &str,
        pixels: Option<PixelNorm>,
    ) -> Option<Arc<dyn StagedModel>> {
        let key = model_key(arch, weights, pixels);
        self.models
            .lock()
            .ok()
            .and_then(|m| m.iter().find(|(k, _)| *k == key).map(|(_, m)| m.clone()))
    }

    async fn model(
        &self,
        ctx: &OperatorContext,
        arch: Arch,
        weights: &str,
        pixels: Option<PixelNorm>,
    ) -> Result<Arc<dyn StagedModel>> {
        if let Some(m) = self.loaded(arch, weights, pixels) {
            return Ok(m);
        }
        let _one_at_a_time = self.loading.lock().await;
        if let Some(m) = self.loaded(arch, weights, pixels) {
            return Ok(m);
        }
        let key = model_key(arch, weights, pixels);
        let started = std::time::Instant::now();
        let table = ctx.node.tables.table(weights).map_err(|e| match e {
            csd_protocol::Error::NotFound(_) => Error::InvalidArgument(format!(
                "weights {weights} are not stored at this node (upload them first)"
            )),
            other => other.into(),
        })?;
        let batches = read_table(ctx, table.objects_of(&[])?, 8, None).await?;
        let bytes = crate::weights::from_batches(weights, &batches)?;
        // On the node's ML threads, not its async ones: building a model is CPU work
        // (an ONNX model's includes an onnxruntime session and a probe run).
        let pool = self.pool(ctx.node.pool.threads(), ctx.node.pool.cores())?;
        let model: Arc<dyn StagedModel> = blocking(Some(pool), move || {
            Ok::<Arc<dyn StagedModel>, _>(match arch {
                Arch::Onnx => Arc::new(OnnxModelStages::load(&bytes, pixels.unwrap_or_default())?),
                arch => Arc::from(arch.load(&bytes, &Device::Cpu)?),
            })
        })
        .await?;
        tracing::debug!(
            secs = started.elapsed().as_secs_f64(),
            engine = model.engine(),
            "{arch} loaded"
        );
        if let Ok(mut m) = self.models.lock() {
            m.push_front((key, model.clone()));
            m.truncate(self.options.cached_models.max(1));
        }
        Ok(model)
    }
}

/// Reads `objects` in order (first `limit` rows), `batch` rows at a time, counting bytes.
async fn read_table(
    ctx: &OperatorContext,
    objects: Vec<ParquetObject>,
    batch: usize,
    limit: Option<u64>,
) -> Result<Vec<RecordBatch>> {
    read_stream(ctx, objects, batch, limit)?.try_collect().await
}

fn read_stream(
    ctx: &OperatorContext,
    objects: Vec<ParquetObject>,
    batch: usize,
    limit: Option<u64>,
) -> Result<futures::stream::BoxStream<'static, Result<RecordBatch>>> {
    let store = ctx.node.tables.object_store().clone();
    let counter = ctx.metrics.bytes_read.clone();
    let mut streams = Vec::new();
    for o in objects {
        let reader = ObjectReader::new(store.clone(), o.object.clone())
            .with_counter(counter.clone())
            .with_metadata(o.metadata.metadata().clone());
        streams.push(
            ParquetRecordBatchStreamBuilder::new_with_metadata(reader, o.metadata.clone())
                .with_batch_size(batch)
                .build()?,
        );
    }
    let s = futures::stream::iter(streams)
        .flatten()
        .map_err(Error::from);
    Ok(match limit {
        None => s.boxed(),
        Some(n) => {
            let mut left = n as usize;
            s.try_take_while(move |_| futures::future::ready(Ok(left > 0)))
                .map_ok(move |b| {
                    let take = b.num_rows().min(left);
                    left -= take;
                    b.slice(0, take)
                })
                .boxed()
        }
    })
}

/// An `ml` request, decoded once: the request, the partition's objects at this
/// node, and its batch plan.
struct MlCall {
    op: Arc<MlOperator>,
    request: FeatureRequest,
    objects: Vec<ParquetObject>,
    plan: BatchPlan,
}

impl Operator for MlOperator {
    fn name(&self) -> &'static str {
        OPERATOR_NAME
    }

    fn parse(self: Arc<Self>, args: Bytes) -> csd_runtime::Result<Box<dyn OperatorRequest>> {
        Ok(Box::new(Parsed {
            op: self,
            request: FeatureRequest::decode(&args)?,
            reserved: OnceLock::new(),
        }))
    }

    fn memory_used(&self) -> u64 {
        self.memory_used.load(Ordering::Relaxed)
    }
}

/// An `ml` request as decoded, before it met the node's catalog.
struct Parsed {
    op: Arc<MlOperator>,
    request: FeatureRequest,
    /// The memory its estimate asked admission for.
    reserved: OnceLock<u64>,
}

impl Parsed {
    /// The partition's objects at this node (from the catalog).
    fn objects(&self, ctx: &OperatorContext) -> Result<Vec<ParquetObject>> {
        let r = &self.request;
        let t = ctx.node.tables.table(&r.dataset)?;
        dataset::check_schema(&r.dataset, &t.schema)?;
        Ok(t.objects_of(&[r.partition.as_str()])?)
    }

    /// The batch plan: with the stages of `onnx` (the request's ONNX model, loaded),
    /// else of the request's built-in architecture.
    fn plan(&self, ctx: &OperatorContext, onnx: Option<&dyn StagedModel>) -> Result<BatchPlan> {
        let r = &self.request;
        let (stages, input) = match onnx {
            Some(m) => (m.stages().to_vec(), m.input_shape()),
            None => (r.model.stages(), r.model.input().shape()),
        };
        Ok(batch_plan(
            &stages,
            &input,
            if r.mode == Mode::Profile {
                stages.len()
            } else {
                r.split
            },
            weights_len(&r.weights)?,
            ctx.node.pool.threads(),
            ctx.node.memory_budget,
            r.max_batch.unwrap_or(DEFAULT_NODE_BATCH),
        ))
    }

    /// The batch plan, when it is known without loading anything: a built-in
    /// architecture's stages are fixed; an ONNX model's are known once it is loaded.
    fn known_plan(&self, ctx: &OperatorContext) -> Result<Option<BatchPlan>> {
        let r = &self.request;
        if r.model != Arch::Onnx {
            return self.plan(ctx, None).map(Some);
        }
        self.op
            .loaded(r.model, &r.weights, r.pixels)
            .map(|m| self.plan(ctx, Some(m.as_ref())))
            .transpose()
    }

    /// The request with its partition's objects and its batch plan. An ONNX model's
    /// stages are known once its file is read: it is loaded (and kept) first — here,
    /// after admission, never in the estimate.
    async fn at(&self, ctx: &OperatorContext) -> Result<MlCall> {
        let r = &self.request;
        let objects = self.objects(ctx)?;
        let plan = match r.model {
            Arch::Onnx => {
                let m = self.op.model(ctx, r.model, &r.weights, r.pixels).await?;
                let n = m.stages().len();
                if r.mode == Mode::Features && !(1..=n).contains(&r.split) {
                    return Err(Error::InvalidArgument(format!(
                        "split {} is out of range for this ONNX model: the node runs cut \
                         points [1, {n}] (0 means no pushdown: read the dataset instead)",
                        r.split
                    )));
                }
                self.plan(ctx, Some(m.as_ref()))?
            }
            _ => self.plan(ctx, None)?,
        };
        Ok(MlCall {
            op: self.op.clone(),
            request: r.clone(),
            objects,
            plan,
        })
    }
}

/// What an estimate reserves for a request whose plan is not known yet (an ONNX
/// model not loaded here): the most a plan that fits takes, half the node's budget.
fn plan_ceiling(ctx: &OperatorContext) -> u64 {
    ctx.node.memory_budget / 2
}

#[async_trait]
impl OperatorRequest for Parsed {
    fn tables(&self) -> Vec<String> {
        vec![self.request.dataset.clone(), self.request.weights.clone()]
    }

    /// From the catalog and what is loaded here: nothing is read or loaded (an ONNX
    /// model not loaded yet reserves [`plan_ceiling`], and is loaded once admitted).
    async fn estimate(&self, ctx: &OperatorContext) -> csd_runtime::Result<Estimate> {
        let r = &self.request;
        let objects = self.objects(ctx)?;
        let memory = match self.known_plan(ctx)? {
            Some(plan) => plan.memory,
            None => plan_ceiling(ctx),
        };
        let _ = self.reserved.set(memory);
        let rows: u64 = objects.iter().map(|o| o.rows()).sum();
        let bytes: u64 = objects.iter().map(|o| o.object.len).sum();
        let bytes = match (r.mode, r.limit) {
            (Mode::Profile, _) => bytes.min(bytes * PROFILE_SAMPLES as u64 / rows.max(1)),
            (_, Some(l)) if rows > 0 => bytes.min(bytes * l / rows + 1),
            _ => bytes,
        };
        Ok(Estimate {
            bytes,
            memory,
            shape: None,
        })
    }

    async fn open(self: Box<Self>, ctx: OperatorContext) -> csd_runtime::Result<OperatorStream> {
        let call = self.at(&ctx).await?;
        let reserved = self.reserved.get().copied().unwrap_or(u64::MAX);
        if call.plan.memory > reserved {
            // Admitted on the ceiling (its model was not loaded when estimated, even
            // if another request has loaded it since); its batch of one needs more:
            // the compute tier runs it, as admission would have decided had the plan
            // been known.
            return Err(csd_protocol::Error::PushedBack(csd_protocol::PushBack {
                reason: format!(
                    "the model's batch of one needs {}, more than half this node's memory budget ({})",
                    csd_protocol::ByteSize(call.plan.memory),
                    csd_protocol::ByteSize(ctx.node.memory_budget)
                ),
                predicted_delay_ms: 0.0,
                estimate_ms: 0.0,
                bytes: 0,
                cause: csd_protocol::PushBackCause::Admission,
            }));
        }
        Ok(call.open(ctx).await?)
    }
}

impl MlCall {
    async fn open(self, ctx: OperatorContext) -> Result<OperatorStream> {
        let MlCall {
            op,
            request: r,
            objects,
            plan,
        } = self;
        let pool = op.pool(ctx.node.pool.threads(), ctx.node.pool.cores())?;
        let model = op.model(&ctx, r.model, &r.weights, r.pixels).await?;
        ctx.metrics.set_details(&MlDetails {
            node_batch: Some(plan.batch),
            memory_reserved: Some(plan.memory),
            split: Some(r.split),
            ..MlDetails::default()
        });
        let guard = MemoryGuard::new(op.memory_used.clone(), ctx.node.memory.clone(), plan.memory);
        if r.mode == Mode::Profile {
            let key = profile_key(&r, model.engine(), &objects, ctx.node.pool.threads());
            let cached = op.profiles.get(&key);
            let profile_cached = cached.is_some();
            let profile = match cached {
                Some(p) => p,
                None => {
                    let limit = Some(PROFILE_SAMPLES as u64);
                    let batches = read_table(&ctx, objects, PROFILE_SAMPLES, limit).await?;
                    let m = model.clone();
                    let batch = plan.batch.min(PROFILE_BATCH);
                    let p = blocking(Some(pool.clone()), move || {
                        profile(m.as_ref(), &batches, batch)
                    })
                    .await?;
                    op.profiles.insert(key, p.clone());
                    p
                }
            };
            ctx.metrics.set_details(&MlDetails {
                profile_cached: Some(profile_cached),
                profile: Some(profile),
                ..MlDetails::default()
            });
            let schema = feature_schema(1, r.dtype);
            drop(guard);
            return Ok(OperatorStream {
                schema,
                batches: futures::stream::empty().boxed(),
            });
        }
        let dim = model.stages()[r.split - 1].out_elems();
        let schema = feature_schema(dim, r.dtype);
        let out_schema = schema.clone();
        let metrics = ctx.metrics.clone();
        let at: Arc<str> = format!("dataset {} partition {}", r.dataset, r.partition).into();
        let skip = r.skip_bad_samples;
        let skipped = Arc::new(AtomicU64::new(0));
        let batches = read_stream(&ctx, objects, plan.batch, r.limit)?
            .and_then(move |b| {
                let (pool, model, schema, metrics) = (
                    pool.clone(),
                    model.clone(),
                    out_schema.clone(),
                    metrics.clone(),
                );
                let _hold = &guard;
                let split = r.split;
                let at = at.clone();
                let skipped = skipped.clone();
                async move {
                    let samples = Samples::from_batch(&b)?;
                    metrics
                        .rows_scanned
                        .fetch_add(samples.len() as u64, Ordering::Relaxed);
                    // Off the async workers: a batch takes seconds, and a worker
                    // held that long stalls every other request the node serves
                    // (with one core, one worker: the raw reads of the partitions
                    // the compute tier runs itself waited for this whole stream).
                    // The features' Arrow batch too: a copy of every value.
                    let dtype = r.dtype;
                    let t = std::time::Instant::now();
                    let (batch, bad) = blocking(Some(pool), move || {
                        let (samples, x, bad) =
                            decodable(model.as_ref(), samples, skip).map_err(|e| match e {
                                Error::InvalidArgument(why) => {
                                    Error::InvalidArgument(format!("{at}: {why}"))
                                }
                                e => e,
                            })?;
                        let batch = match x {
                            Some(x) => {
                                let f = forward_range_chunked(model.as_ref(), &x, 0, split)?;
                                to_batch(&schema, &samples.ids, &samples.labels, &f, dtype)?
                            }
                            None => RecordBatch::new_empty(schema),
                        };
                        Ok::<_, Error>((batch, bad))
                    })
                    .await?;
                    tracing::debug!(
                        rows = batch.num_rows(),
                        secs = t.elapsed().as_secs_f64(),
                        "node batch"
                    );
                    if bad > 0 {
                        let total = skipped.fetch_add(bad, Ordering::Relaxed) + bad;
                        metrics.set_details(&MlDetails {
                            skipped_samples: Some(total),
                            ..MlDetails::default()
                        });
                    }
                    Ok(batch)
                }
            })
            .map_err(csd_runtime::Error::from)
            .boxed();
        Ok(OperatorStream { schema, batches })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// The operator is built from the node's settings; a misspelt key is an error
    /// naming it.
    #[test]
    fn ml_options_come_from_the_node_settings() {
        let mut c = csd_runtime::config::NodeConfig::default();
        assert_eq!(
            MlOperator::from_config(&c).unwrap().options.cached_models,
            4
        );
        c.set = vec!["ml.cached_models=2".into()];
        assert_eq!(
            MlOperator::from_config(&c).unwrap().options.cached_models,
            2
        );
        c.set = vec!["ml.cached_model=2".into()];
        let e = MlOperator::from_config(&c).err().unwrap();
        assert!(e.to_string().contains("cached_model"), "{e}");
    }

    /// A running request's memory is in the node's ledger beside the SQL pools,
    /// even past what pools may take (admission reserved it), and leaves with it.
    #[test]
    fn a_requests_memory_is_in_the_ledger_while_it_runs() {
        let ledger = MemoryLedger::measuring(1 << 30, || Some(0));
        let used = Arc::new(AtomicU64::new(0));
        let a = MemoryGuard::new(used.clone(), ledger.clone(), 300 << 20);
        let b = MemoryGuard::new(used.clone(), ledger.clone(), 900 << 20);
        assert_eq!(ledger.pooled(), 1200 << 20);
        assert_eq!(used.load(Ordering::Relaxed), 1200 << 20);
        assert!(!ledger.try_take(1), "a SQL pool finds no room left");
        drop(b);
        assert_eq!(ledger.pooled(), 300 << 20);
        assert!(ledger.try_take(1 << 20), "and room again when it ends");
        ledger.give_back(1 << 20);
        drop(a);
        assert_eq!((ledger.pooled(), used.load(Ordering::Relaxed)), (0, 0));
    }
}
