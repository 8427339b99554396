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
use crate::request::FeatureType;
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
/// repeated; see [`PROFILE_BATCH`](crate::request::PROFILE_BATCH)), and its stages
/// scaled to it.
pub fn profile(model: &dyn StagedModel, batches: &[RecordBatch], batch: usize) -> Result<Profile> {
    let mut n = 0usize;
    let mut bytes = 0u64;
    let mut decode = 0f64;
    let mut stage = vec![0f64; model.stages().len()];
    let mut whole = 0f64;
    // The first timed samples as decoded, for the whole model at `batch` below.
    let mut first: Option<Tensor> = None;
    // One sample through every stage first, untimed and stage by stage as timed
    // below: a first pass pays for thread start-up and page faults on fresh scratch
    // buffers (and, for an ONNX model, for creating each stage's session), which an
    // epoch does not, and would make two profiles of the same thing disagree.
    if let Some(b) = batches.iter().find(|b| b.num_rows() > 0) {
        let s = Samples::from_batch(&b.slice(0, 1))?;
        let x0 = inputs(model, &s)?;
        if model.runs_ranges_fused() {
            model.forward_range(&x0, 0, model.stages().len())?;
        }
        let mut x = x0;
        for i in 0..model.stages().len() {
            x = model.forward_stage(i, &x)?;
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
        first.get_or_insert_with(|| x.clone());
        decode += t.elapsed().as_secs_f64();
        if model.runs_ranges_fused() {
            let t = Instant::now();
            model.forward_range(&x, 0, stage.len())?;
            whole += t.elapsed().as_secs_f64();
        }
        for (i, acc) in stage.iter_mut().enumerate() {
            let t = Instant::now();
            x = model.forward_stage(i, &x)?;
            *acc += t.elapsed().as_secs_f64();
        }
    }
    // The whole model at the batch size epochs run: the first samples repeated.
    if model.runs_ranges_fused()
        && n > 0
        && batch > n
        && let Some(x) = first
    {
        let rows = x.dim(0)?;
        let xs = vec![x; batch.div_ceil(rows)];
        let big = Tensor::cat(&xs, 0)?;
        // Once untimed: onnxruntime's first run at a new batch size grows its
        // memory arena, which an epoch pays once.
        model.forward_range(&big, 0, stage.len())?;
        let t = Instant::now();
        model.forward_range(&big, 0, stage.len())?;
        whole = t.elapsed().as_secs_f64() * n as f64 / big.dim(0)? as f64;
    }
    // Stage by stage, a model whose ranges run fused is slower than it runs
    // (EfficientNet-Lite0 as ONNX, its 93 stages timed one session each, added up to
    // about 8x its whole-model session, which made the link look cheap next to the
    // layers): the stages keep their proportions and add up to the whole model's time.
    let staged: f64 = stage.iter().sum();
    if whole > 0.0 && staged > 0.0 {
        for s in &mut stage {
            *s *= whole / staged;
        }
    }
    // The stages' own sessions served the timing only (a profile is kept, not
    // measured again).
    model.release_stage_sessions();
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
