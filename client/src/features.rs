//! `csd features` and the Python package's feature streams: the model a user names
//! loaded as the job takes it, and a feature stream written as Parquet. The job
//! itself (put, split planning, the stream) is `csd_ml_pushdown::job`.

use std::path::Path;

use csd_ml_pushdown::features::{feature_schema, to_batch};
use csd_ml_pushdown::request::FeatureType;
use csd_ml_pushdown::stream::TrainBatch;
use futures::TryStreamExt;
use indicatif::ProgressBar;

pub use csd_ml_pushdown::job::*;

use crate::{Error, Result};

/// A model as a feature job takes it: its architecture, the bytes uploaded to the
/// nodes (the weights, or an ONNX model's file), and an ONNX model's pixel
/// normalisation.
#[derive(Debug, Clone)]
pub struct Model {
    /// The architecture.
    pub arch: csd_ml_pushdown::Arch,
    /// What the nodes get: the weights (with a text model's tokenizer inside), or
    /// the ONNX file.
    pub bytes: Vec<u8>,
    /// An ONNX model's normalisation (`None` for a built-in model).
    pub pixels: Option<csd_ml_pushdown::model::PixelNorm>,
}

impl Model {
    /// `model` as a user names it: a built-in architecture (`efficientnet-lite0`,
    /// `resnet18`, …) with its `weights` file (and a text model's `tokenizer`), or an
    /// ONNX image model's file (`*.onnx`), whose pixels are normalised by `mean` and
    /// `std` (default 0 and 1).
    pub fn load(
        model: &str,
        weights: Option<&Path>,
        tokenizer: Option<&Path>,
        mean: Option<[f32; 3]>,
        std: Option<[f32; 3]>,
    ) -> Result<Model> {
        if model.ends_with(".onnx") {
            if weights.is_some() {
                return Err(Error::InvalidInput(
                    "an ONNX model carries its weights: leave out --weights".into(),
                ));
            }
            let bytes = std::fs::read(model).map_err(|e| Error::io(model, e))?;
            return Ok(Model {
                arch: csd_ml_pushdown::Arch::Onnx,
                bytes,
                pixels: Some(csd_ml_pushdown::model::PixelNorm {
                    mean: mean.unwrap_or([0.0; 3]),
                    std: std.unwrap_or([1.0; 3]),
                }),
            });
        }
        if mean.is_some() || std.is_some() {
            return Err(Error::InvalidInput(
                "--mean, --std and --list-splits are for ONNX models (--model FILE.onnx)".into(),
            ));
        }
        let arch: csd_ml_pushdown::Arch = model.parse().map_err(Error::Ml)?;
        let path = weights
            .ok_or_else(|| Error::InvalidInput(format!("--weights is required for {arch}")))?;
        let mut bytes = std::fs::read(path).map_err(|e| Error::io(path.display(), e))?;
        if let Some(t) = tokenizer {
            let json = std::fs::read(t).map_err(|e| Error::io(t.display(), e))?;
            bytes = csd_ml_pushdown::weights::with_tokenizer(&bytes, &json)?;
        }
        Ok(Model {
            arch,
            bytes,
            pixels: None,
        })
    }
}

/// Drains a feature stream into a Parquet file of `id, label, features`.
pub async fn write_parquet(
    mut s: futures::stream::BoxStream<'static, csd_ml_pushdown::Result<TrainBatch>>,
    out: Option<&Path>,
    bar: &ProgressBar,
) -> Result<u64> {
    let mut writer = None;
    let mut rows = 0u64;
    while let Some(b) = s.try_next().await? {
        rows += b.ids.len() as u64;
        bar.inc(b.ids.len() as u64);
        if let Some(path) = out {
            let dim = b.features.dim(1).map_err(csd_ml_pushdown::Error::from)?;
            let schema = feature_schema(dim, FeatureType::F32);
            let batch = to_batch(&schema, &b.ids, &b.labels, &b.features, FeatureType::F32)?;
            if writer.is_none() {
                let f = std::fs::File::create(path).map_err(|e| Error::io(path.display(), e))?;
                writer = Some(
                    parquet::arrow::ArrowWriter::try_new(f, schema, None)
                        .map_err(|e| Error::parquet(path.display(), e))?,
                );
            }
            if let Some(w) = writer.as_mut() {
                w.write(&batch)
                    .map_err(|e| Error::parquet(path.display(), e))?;
            }
        }
    }
    if let Some(w) = writer {
        w.close()
            .map_err(|e| Error::parquet("closing the features file", e))?;
    }
    Ok(rows)
}
