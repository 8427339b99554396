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
//! so a request whose single sample cannot fit is pushed back, never run.
//!
//! **CPU.** Decoding and layers run on a rayon pool with as many threads as the node
//! has CPUs (`--cpus`), so candle's matrix products never use cores outside the budget;
//! with `--cpu-set` its threads are pinned to the same cores as the node's CPU pool.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use arrow::array::{
    ArrayRef, FixedSizeListArray, Float16Array, Float32Array, Int64Array, UInt64Array,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::record_batch::RecordBatch;
use async_trait::async_trait;
use bytes::Bytes;
use candle_core::{DType, Device, Tensor};
use csd_runtime::operator::{Estimate, Operator, OperatorContext, OperatorStream};
use csd_runtime::table::{ObjectReader, ParquetObject};
use futures::{StreamExt, TryStreamExt};
use parquet::arrow::ParquetRecordBatchStreamBuilder;
use serde::{Deserialize, Serialize};

use crate::dataset::{self, Samples};
use crate::model::{Arch, StagedModel};
use crate::planner::{Profile, ProfileCache};
use crate::request::{FeatureRequest, FeatureType, MAX_NODE_BATCH, Mode};
use crate::{Error, Result};

/// Memory held back per worker for decoding one image (see
/// [`preprocess::MAX_IMAGE_ALLOC`]).
pub(crate) const DECODE_RESERVE: u64 = 32 << 20;
/// Node batch when the request sets no cap.
pub(crate) const DEFAULT_NODE_BATCH: usize = 32;
/// Samples a profile request times.
pub const PROFILE_SAMPLES: usize = 4;
const CACHED_MODELS: usize = 4;

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
    arch: Arch,
    split: usize,
    weights_len: u64,
    threads: usize,
    budget: u64,
    cap: usize,
) -> BatchPlan {
    let stages = arch.stages();
    let input = arch.input().shape().iter().product::<usize>() as u64 * 4;
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
    models: Mutex<VecDeque<(String, Arc<dyn StagedModel>)>>,
    loading: tokio::sync::Mutex<()>,
    pool: OnceLock<Arc<rayon::ThreadPool>>,
    memory_used: Arc<AtomicU64>,
    /// Profiles measured lately, by [`profile_key`].
    profiles: ProfileCache,
}

/// What a profile depends on: the partition's objects (ids change when replaced), the
/// model and weights, and the pool's threads.
fn profile_key(r: &FeatureRequest, objects: &[ParquetObject], threads: usize) -> String {
    let ids: Vec<String> = objects.iter().map(|o| o.object.id.to_string()).collect();
    format!(
        "{}/{}/{}/{}/{threads}/{}",
        r.dataset,
        r.partition,
        r.model,
        r.weights,
        ids.join(",")
    )
}

struct MemoryGuard(Arc<AtomicU64>, u64);
impl Drop for MemoryGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::Relaxed);
    }
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
    /// A new operator (models load on first use).
    pub fn new() -> Self {
        Self::default()
    }

    fn pool(&self, threads: usize, cores: Option<&[usize]>) -> Result<Arc<rayon::ThreadPool>> {
        if let Some(p) = self.pool.get() {
            return Ok(p.clone());
        }
        let p = crate::thread_pool("csd-ml", threads, cores)?;
        Ok(self.pool.get_or_init(|| Arc::new(p)).clone())
    }

    async fn model(
        &self,
        ctx: &OperatorContext,
        arch: Arch,
        weights: &str,
    ) -> Result<Arc<dyn StagedModel>> {
        let key = format!("{arch}/{weights}");
        let cached = |models: &Mutex<VecDeque<(String, Arc<dyn StagedModel>)>>| {
            models
                .lock()
                .ok()
                .and_then(|m| m.iter().find(|(k, _)| *k == key).map(|(_, m)| m.clone()))
        };
        if let Some(m) = cached(&self.models) {
            return Ok(m);
        }
        let _one_at_a_time = self.loading.lock().await;
        if let Some(m) = cached(&self.models) {
            return Ok(m);
        }
        let table = ctx.node.tables.table(weights).map_err(|e| match e {
            csd_runtime::Error::NotFound(_) => Error::InvalidArgument(format!(
                "weights {weights} are not stored at this node (upload them first)"
            )),
            other => other.into(),
        })?;
        let batches = read_table(
            ctx,
            table.partitions.values().flatten().cloned().collect(),
            8,
            None,
        )
        .await?;
        let bytes = crate::weights::from_batches(weights, &batches)?;
        let model: Arc<dyn StagedModel> = Arc::from(arch.load(&bytes, &Device::Cpu)?);
        if let Ok(mut m) = self.models.lock() {
            m.push_front((key, model.clone()));
            m.truncate(CACHED_MODELS);
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

/// Schema of the features stream.
pub fn feature_schema(dim: usize, dtype: FeatureType) -> SchemaRef {
    let item = match dtype {
        FeatureType::F32 => DataType::Float32,
        FeatureType::F16 => DataType::Float16,
    };
    Arc::new(Schema::new(vec![
        Field::new(dataset::ID, DataType::UInt64, false),
        Field::new(dataset::LABEL, DataType::Int64, false),
        Field::new(
            "features",
            DataType::FixedSizeList(Arc::new(Field::new("item", item, false)), dim as i32),
            false,
        ),
    ]))
}

/// Packs a `[N, ...]` tensor and its ids/labels as a features batch.
pub fn to_batch(
    schema: &SchemaRef,
    ids: &[u64],
    labels: &[i64],
    t: &Tensor,
    dtype: FeatureType,
) -> Result<RecordBatch> {
    let n = t.dim(0)?;
    let dim = t.elem_count() / n.max(1);
    let flat = t.flatten_all()?;
    let values: ArrayRef = match dtype {
        FeatureType::F32 => Arc::new(Float32Array::from(
            flat.to_dtype(DType::F32)?.to_vec1::<f32>()?,
        )),
        FeatureType::F16 => Arc::new(Float16Array::from(
            flat.to_dtype(DType::F16)?.to_vec1::<half::f16>()?,
        )),
    };
    let item = match dtype {
        FeatureType::F32 => DataType::Float32,
        FeatureType::F16 => DataType::Float16,
    };
    let list = FixedSizeListArray::try_new(
        Arc::new(Field::new("item", item, false)),
        dim as i32,
        values,
        None,
    )?;
    Ok(RecordBatch::try_new(
        schema.clone(),
        vec![
            Arc::new(UInt64Array::from(ids.to_vec())),
            Arc::new(Int64Array::from(labels.to_vec())),
            Arc::new(list),
        ],
    )?)
}

/// [`inputs`] of the samples that decode: with `skip`, undecodable samples are left
/// out (and counted) instead of failing the batch. `None` when none is left.
pub(crate) fn decodable(
    model: &dyn StagedModel,
    samples: Samples,
    skip: bool,
) -> Result<(Samples, Option<Tensor>, u64)> {
    match inputs(model, &samples) {
        Ok(x) => Ok((samples, Some(x), 0)),
        Err(Error::InvalidArgument(why)) if skip => {
            let keep: Vec<bool> = samples
                .bytes()?
                .iter()
                .map(|b| model.prepare(&[b]).is_ok())
                .collect();
            let skipped = keep.iter().filter(|k| !**k).count() as u64;
            if skipped == 0 {
                return Err(Error::InvalidArgument(why));
            }
            let kept = samples.retain(&keep)?;
            if kept.is_empty() {
                return Ok((kept, None, skipped));
            }
            let x = inputs(model, &kept)?;
            Ok((kept, Some(x), skipped))
        }
        Err(e) => Err(e),
    }
}

/// Decodes and preprocesses `samples` into `model`'s input tensor. A sample that
/// cannot be decoded is named by its id.
pub fn inputs(model: &dyn StagedModel, samples: &Samples) -> Result<Tensor> {
    let bytes = samples.bytes()?;
    model.prepare(&bytes).map_err(|e| match e {
        Error::InvalidArgument(why) => {
            let bad = bytes.iter().position(|b| model.prepare(&[b]).is_err());
            match bad.and_then(|i| samples.ids.get(i)) {
                Some(id) => Error::InvalidArgument(format!("sample id {id}: {why}")),
                None => Error::InvalidArgument(why),
            }
        }
        e => e,
    })
}

impl MlOperator {
    fn request(
        ctx: &OperatorContext,
        args: &Bytes,
    ) -> Result<(FeatureRequest, Vec<ParquetObject>, BatchPlan)> {
        let r = FeatureRequest::decode(args)?;
        let t = ctx.node.tables.table(&r.dataset)?;
        dataset::check_schema(&r.dataset, &t.schema)?;
        let objects = t.partitions.get(&r.partition).cloned().ok_or_else(|| {
            Error::Node(csd_runtime::Error::NotFound(format!(
                "partition {} of dataset {}",
                r.partition, r.dataset
            )))
        })?;
        let plan = batch_plan(
            r.model,
            if r.mode == Mode::Profile {
                r.model.stages().len()
            } else {
                r.split
            },
            weights_len(&r.weights)?,
            ctx.node.pool.threads(),
            ctx.node.memory_budget,
            r.max_batch.unwrap_or(DEFAULT_NODE_BATCH),
        );
        Ok((r, objects, plan))
    }
}

#[async_trait]
impl Operator for MlOperator {
    fn name(&self) -> &'static str {
        "ml"
    }

    fn tables(&self, args: &Bytes) -> csd_runtime::Result<Vec<String>> {
        let r = FeatureRequest::decode(args)?;
        Ok(vec![r.dataset, r.weights])
    }

    async fn estimate(&self, ctx: &OperatorContext, args: &Bytes) -> csd_runtime::Result<Estimate> {
        let (r, objects, plan) = Self::request(ctx, args)?;
        let rows: u64 = objects.iter().map(|o| o.rows()).sum();
        let bytes: u64 = objects.iter().map(|o| o.object.len).sum();
        let bytes = match (r.mode, r.limit) {
            (Mode::Profile, _) => bytes.min(bytes * PROFILE_SAMPLES as u64 / rows.max(1)),
            (_, Some(l)) if rows > 0 => bytes.min(bytes * l / rows + 1),
            _ => bytes,
        };
        Ok(Estimate {
            bytes,
            memory: plan.memory,
            shape: None,
        })
    }

    async fn open(&self, ctx: OperatorContext, args: Bytes) -> csd_runtime::Result<OperatorStream> {
        let (r, objects, plan) = Self::request(&ctx, &args)?;
        let pool = self.pool(ctx.node.pool.threads(), ctx.node.pool.cores())?;
        let model = self.model(&ctx, r.model, &r.weights).await?;
        ctx.metrics.set_detail("node_batch", plan.batch);
        ctx.metrics.set_detail("memory_reserved", plan.memory);
        ctx.metrics.set_detail("split", r.split);
        self.memory_used.fetch_add(plan.memory, Ordering::Relaxed);
        let guard = MemoryGuard(self.memory_used.clone(), plan.memory);
        if r.mode == Mode::Profile {
            let key = profile_key(&r, &objects, ctx.node.pool.threads());
            let cached = self.profiles.get(&key);
            ctx.metrics
                .set_detail("profile_cached", u64::from(cached.is_some()));
            let profile = match cached {
                Some(p) => p,
                None => {
                    let limit = Some(PROFILE_SAMPLES as u64);
                    let batches = read_table(&ctx, objects, PROFILE_SAMPLES, limit).await?;
                    let m = model.clone();
                    let p = crate::stream::blocking(Some(pool.clone()), move || {
                        profile(m.as_ref(), &batches)
                    })
                    .await?;
                    self.profiles.insert(key, p.clone());
                    p
                }
            };
            ctx.metrics.set_detail(
                "profile",
                serde_json::to_string(&profile).unwrap_or_default(),
            );
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
                    let (samples, features, bad) = pool.install(|| {
                        let (samples, x, bad) =
                            decodable(model.as_ref(), samples, skip).map_err(|e| match e {
                                Error::InvalidArgument(why) => {
                                    Error::InvalidArgument(format!("{at}: {why}"))
                                }
                                e => e,
                            })?;
                        let f = x.map(|x| model.forward_range(&x, 0, split)).transpose()?;
                        Ok::<_, Error>((samples, f, bad))
                    })?;
                    if bad > 0 {
                        let total = skipped.fetch_add(bad, Ordering::Relaxed) + bad;
                        metrics.set_detail("skipped_samples", total);
                    }
                    match features {
                        Some(f) => to_batch(&schema, &samples.ids, &samples.labels, &f, r.dtype),
                        None => Ok(RecordBatch::new_empty(schema.clone())),
                    }
                }
            })
            .map_err(csd_runtime::Error::from)
            .boxed();
        Ok(OperatorStream { schema, batches })
    }

    fn memory_used(&self) -> u64 {
        self.memory_used.load(Ordering::Relaxed)
    }
}

/// Times decoding and every stage (per sample) on `batches` (the first samples), after
/// one untimed warm-up sample.
pub fn profile(model: &dyn StagedModel, batches: &[RecordBatch]) -> Result<Profile> {
    let mut n = 0usize;
    let mut bytes = 0u64;
    let mut decode = 0f64;
    let mut stage = vec![0f64; model.stages().len()];
    // One sample through everything first, untimed: a first pass pays for thread
    // start-up and page faults on fresh scratch buffers, which an epoch does not, and
    // would make two profiles of the same thing disagree.
    if let Some(b) = batches.iter().find(|b| b.num_rows() > 0) {
        let s = Samples::from_batch(&b.slice(0, 1))?;
        model.forward_range(&inputs(model, &s)?, 0, model.stages().len())?;
    }
    for b in batches {
        let s = Samples::from_batch(b)?;
        if s.is_empty() {
            continue;
        }
        n += s.len();
        bytes += s.bytes()?.iter().map(|b| b.len() as u64).sum::<u64>();
        let t = Instant::now();
        let mut x = inputs(model, &s)?;
        decode += t.elapsed().as_secs_f64();
        for (i, acc) in stage.iter_mut().enumerate() {
            let t = Instant::now();
            x = model.forward_stage(i, &x)?;
            *acc += t.elapsed().as_secs_f64();
        }
    }
    if n == 0 {
        return Err(Error::InvalidArgument(
            "the dataset partition is empty: nothing to profile".into(),
        ));
    }
    let per = |v: f64| v / n as f64;
    Ok(Profile {
        samples: n,
        sample_bytes: bytes as f64 / n as f64,
        decode_s: per(decode),
        stage_s: stage.into_iter().map(per).collect(),
    })
}
