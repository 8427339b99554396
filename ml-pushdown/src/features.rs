//! Feature extraction as both sides run it: samples decoded and preprocessed into a
//! model's input tensor ([`inputs`], [`decodable`]), a stage's output packed as a
//! features batch ([`to_batch`], [`feature_schema`]), what that costs per sample
//! ([`profile`]), work run off the async threads ([`blocking`]).

use std::sync::Arc;
use std::time::Instant;

use arrow::array::{
    ArrayRef, FixedSizeListArray, Float16Array, Float32Array, Int64Array, UInt64Array,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::record_batch::RecordBatch;
use candle_core::{DType, Tensor};

use crate::dataset::{self, Samples};
use crate::model::StagedModel;
use crate::profile::Profile;
use crate::request::{FeatureType, PROFILE_BATCH};
use crate::{Error, Result};

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
pub fn decodable(
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

/// Stages `[from, to)` of `model` on `x`, at most [`PROFILE_BATCH`] samples per
/// thread of the current pool at a time: the batch a profile times on one thread.
/// Larger batches run slower per sample (their activations outgrow the caches), so
/// a batch of the stream's own size (the node's batch, a training batch, a scan's
/// piece) would run slower than planned.
pub fn forward_range_chunked(
    model: &dyn StagedModel,
    x: &Tensor,
    from: usize,
    to: usize,
) -> Result<Tensor> {
    let rows = x.dim(0)?;
    let chunk = PROFILE_BATCH * rayon::current_num_threads().max(1);
    if from >= to || rows <= chunk {
        return model.forward_range(x, from, to);
    }
    let parts = (0..rows)
        .step_by(chunk)
        .map(|at| model.forward_range(&x.narrow(0, at, chunk.min(rows - at))?, from, to))
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&parts, 0)?)
}

/// Runs `f` off the async threads, on `pool` when there is one.
pub async fn blocking<T: Send + 'static>(
    pool: Option<Arc<rayon::ThreadPool>>,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(move || match pool {
        Some(p) => p.install(f),
        None => f(),
    })
    .await
    .map_err(|e| Error::Node(csd_protocol::Error::Internal(format!("worker failed: {e}"))))?
}

/// Times decoding and every stage (per sample) on `batches` (the first samples), after
/// one untimed warm-up sample. A model whose ranges run fused (one onnxruntime
/// session) has its whole time per sample taken at `batch` samples (the first ones
/// repeated; see [`PROFILE_BATCH`](crate::request::PROFILE_BATCH)), and its stages'
/// shares of it from onnxruntime's profile of one run of the whole model
/// ([`StagedModel::stage_times`]).
pub fn profile(model: &dyn StagedModel, batches: &[RecordBatch], batch: usize) -> Result<Profile> {
    let mut n = 0usize;
    let mut bytes = 0u64;
    let mut decode = 0f64;
    let mut stage = vec![0f64; model.stages().len()];
    // The timed samples as decoded, for the fused model's whole-model timings.
    let mut decoded: Vec<Tensor> = Vec::new();
    // Whether the model's stages are timed in one run of the whole (fused) model.
    let fused = model.runs_ranges_fused();
    // One sample through the model first, untimed (stage by stage where stages are
    // timed so): a first pass pays for thread start-up and page faults on fresh
    // scratch buffers (and, for an ONNX model, for creating its session), which an
    // epoch does not, and would make two profiles of the same thing disagree.
    if let Some(b) = batches.iter().find(|b| b.num_rows() > 0) {
        let s = Samples::from_batch(&b.slice(0, 1))?;
        let x = inputs(model, &s)?;
        // (A fused model's timed run is warmed up where it runs, below.)
        if !fused {
            let mut x = x;
            for i in 0..stage.len() {
                x = model.forward_stage(i, &x)?;
            }
        }
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
        if fused {
            decoded.push(x);
            continue;
        }
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
    if fused {
        stage = fused_stage_times(model, &decoded, batch.max(n))?;
    }
    let per = |v: f64| v / n as f64;
    Ok(Profile {
        samples: n,
        sample_bytes: bytes as f64 / n as f64,
        decode_s: per(decode),
        stage_s: stage.into_iter().map(per).collect(),
    })
}

/// Seconds of every stage on `decoded` (the profiled samples, `n` of them) for a
/// model whose ranges run fused: one run of the whole model at `batch` samples (the
/// first ones repeated) under onnxruntime's profiler, after an untimed one, gives
/// the seconds per sample and each stage's share. Timed stage by stage, a fused model
/// adds up to more than it runs (which makes the link look cheap next to the layers),
/// and each stage's session costs its creation.
fn fused_stage_times(
    model: &dyn StagedModel,
    decoded: &[Tensor],
    batch: usize,
) -> Result<Vec<f64>> {
    let x = Tensor::cat(decoded, 0)?;
    let rows = x.dim(0)?;
    let big = Tensor::cat(&vec![x.clone(); batch.div_ceil(rows)], 0)?.narrow(0, 0, batch)?;
    let stages = model.stages().len();
    let t = Instant::now();
    let (per_sample, shares) = model.stage_times(&big).unwrap_or_else(|| {
        Err(Error::Node(csd_protocol::Error::Internal(
            "a model whose ranges run fused did not time its stages".into(),
        )))
    })?;
    tracing::debug!(
        secs = t.elapsed().as_secs_f64(),
        per_sample,
        batch,
        "a fused model's profile: the whole model run twice under onnxruntime's profiler"
    );
    let whole = per_sample * rows as f64;
    let total: f64 = shares.iter().sum();
    Ok(if total > 0.0 {
        shares.iter().map(|s| whole * s / total).collect()
    } else {
        vec![whole / stages.max(1) as f64; stages]
    })
}
