//! A Parquet or CSV file read as Arrow batches for `csd put` (once per copy with
//! `--replicas`), with a progress bar.

use std::path::PathBuf;
use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use csd_client::{Error, Result};
use indicatif::{ProgressBar, ProgressStyle};

/// Reads a Parquet or CSV file on a blocking thread, feeding a channel and a progress
/// bar (rows of the known total for Parquet; a row count for CSV).
pub(super) fn read_file(
    path: PathBuf,
) -> Result<(
    SchemaRef,
    ProgressBar,
    tokio::sync::mpsc::Receiver<csd_protocol::node_client::Result<RecordBatch>>,
)> {
    let file = std::fs::File::open(&path).map_err(|e| Error::io(path.display(), e))?;
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    let bad = |e: &dyn std::fmt::Display| Error::InvalidInput(format!("{}: {e}", path.display()));
    type Batches = Box<dyn Iterator<Item = Result<RecordBatch, arrow::error::ArrowError>> + Send>;
    let (schema, total, reader): (SchemaRef, Option<u64>, Batches) = match ext.as_str() {
        "parquet" | "pq" => {
            let b = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
                .map_err(|e| bad(&e))?;
            let rows = b.metadata().file_metadata().num_rows().max(0) as u64;
            (
                b.schema().clone(),
                Some(rows),
                Box::new(b.with_batch_size(8192).build().map_err(|e| bad(&e))?),
            )
        }
        "csv" => {
            use std::io::Seek;
            let mut file = file;
            let fmt = arrow::csv::reader::Format::default().with_header(true);
            let (schema, _) = fmt
                .infer_schema(&mut file, Some(10_000))
                .map_err(|e| bad(&e))?;
            file.rewind().map_err(|e| bad(&e))?;
            let schema = Arc::new(schema);
            let r = arrow::csv::ReaderBuilder::new(schema.clone())
                .with_format(fmt)
                .build(file)
                .map_err(|e| bad(&e))?;
            (schema, None, Box::new(r))
        }
        _ => {
            return Err(Error::InvalidInput(format!(
                "{}: expected a .parquet or .csv file",
                path.display()
            )));
        }
    };
    let bar = match total {
        Some(n) => ProgressBar::new(n).with_style(
            ProgressStyle::with_template("put [{bar:30}] {pos}/{len} rows {per_sec} eta {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        ),
        None => ProgressBar::new_spinner().with_style(
            ProgressStyle::with_template("put {spinner} {pos} rows {per_sec}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        ),
    };
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let feed = bar.clone();
    std::thread::spawn(move || {
        for b in reader {
            let item = b.map_err(|e| {
                csd_protocol::node_client::Error::InvalidInput(format!("{}: {e}", path.display()))
            });
            if let Ok(b) = &item {
                feed.inc(b.num_rows() as u64);
            }
            if tx.blocking_send(item).is_err() {
                break;
            }
        }
    });
    Ok((schema, bar, rx))
}
