//! `csd features` output: a feature stream written as Parquet. The job itself (put,
//! split planning, the stream) is `csd_ml_pushdown::job`.

use std::path::Path;

use csd_ml_pushdown::operator::{feature_schema, to_batch};
use csd_ml_pushdown::request::FeatureType;
use csd_ml_pushdown::stream::TrainBatch;
use futures::TryStreamExt;
use indicatif::ProgressBar;

pub use csd_ml_pushdown::job::*;

use crate::{Error, Result};

/// The client's error for an ML error.
pub fn ml(e: csd_ml_pushdown::Error) -> Error {
    match e {
        csd_ml_pushdown::Error::Client(c) => c,
        csd_ml_pushdown::Error::InvalidArgument(m) => Error::InvalidInput(m),
        other => Error::Runtime(other.into()),
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
    while let Some(b) = s.try_next().await.map_err(ml)? {
        rows += b.ids.len() as u64;
        bar.inc(b.ids.len() as u64);
        if let Some(path) = out {
            let dim = b.features.dim(1).map_err(|e| ml(e.into()))?;
            let schema = feature_schema(dim, FeatureType::F32);
            let batch =
                to_batch(&schema, &b.ids, &b.labels, &b.features, FeatureType::F32).map_err(ml)?;
            if writer.is_none() {
                let f = std::fs::File::create(path)
                    .map_err(|e| Error::InvalidInput(format!("{}: {e}", path.display())))?;
                writer = Some(
                    parquet::arrow::ArrowWriter::try_new(f, schema, None)
                        .map_err(|e| Error::Protocol(e.to_string()))?,
                );
            }
            if let Some(w) = writer.as_mut() {
                w.write(&batch)
                    .map_err(|e| Error::Protocol(e.to_string()))?;
            }
        }
    }
    if let Some(w) = writer {
        w.close().map_err(|e| Error::Protocol(e.to_string()))?;
    }
    Ok(rows)
}
