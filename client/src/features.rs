//! `csd features` output: a feature stream written as Parquet. The job itself (put,
//! split planning, the stream) is `csd_ml_pushdown::job`.

use std::path::Path;

use csd_ml_pushdown::features::{feature_schema, to_batch};
use csd_ml_pushdown::request::FeatureType;
use csd_ml_pushdown::stream::TrainBatch;
use futures::TryStreamExt;
use indicatif::ProgressBar;

pub use csd_ml_pushdown::job::*;

use crate::{Error, Result};

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
