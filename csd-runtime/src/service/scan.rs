//! Raw reads: a table's (or partition's, or kept result's) Parquet objects decoded
//! and streamed as Arrow IPC (`Scan`, `Ref`), and an object's bytes streamed as they
//! are stored (`Range`: the compute tier's own Parquet reads, and handed-back work).
//! Both run under a raw-read permit, never under operator admission.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use arrow::datatypes::SchemaRef;
use arrow::ipc::writer::IpcWriteOptions;
use arrow_flight::FlightData;
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use parquet::arrow::{ParquetRecordBatchStreamBuilder, ProjectionMask};
use tonic::Status;

use super::FlightNode;
use super::stream::{ENCODER_LIMIT, TaskStream};
use crate::admission::ReadPermit;
use crate::error::{Error, Result, truncated};
use crate::table::{ObjectReader, ParquetObject};

/// Chunk reads a range stream keeps in flight.
const RANGE_READ_AHEAD: usize = 4;
/// Rows per Arrow batch a scan produces.
const SCAN_BATCH_ROWS: usize = 8192;

impl FlightNode {
    /// A raw-read slot: bounded, refused with a retry hint only when saturated.
    pub(super) async fn read_permit(&self) -> Result<ReadPermit> {
        self.state.admission.read().await.map_err(|r| Error::Busy {
            reason: r.reason,
            retry_after: r.retry_after,
        })
    }

    pub(super) fn scan(
        &self,
        table: &str,
        partition: Option<&str>,
        columns: &[String],
        limit: Option<u64>,
        compression: Option<arrow::ipc::CompressionType>,
    ) -> Result<TaskStream> {
        let t = self.state.node.tables.table(table)?;
        let files: Vec<ParquetObject> = match partition {
            Some(p) => t.partitions.get(p).cloned().ok_or_else(|| {
                Error::NotFound(format!(
                    "partition {} of table {}",
                    truncated(p),
                    truncated(table)
                ))
            })?,
            None => t.partitions.values().flatten().cloned().collect(),
        };
        let indices = columns
            .iter()
            .map(|c| {
                t.schema.index_of(c).map_err(|_| {
                    let names: Vec<&str> = t
                        .schema
                        .fields()
                        .iter()
                        .map(|f| f.name().as_str())
                        .collect();
                    Error::InvalidArgument(format!(
                        "column {c:?} is not in table {table} (columns: {})",
                        names.join(", ")
                    ))
                })
            })
            .collect::<Result<Vec<usize>>>()?;
        // Parquet projection returns columns in file order: answer in table order.
        let mut indices = indices;
        indices.sort_unstable();
        indices.dedup();
        let schema: SchemaRef = if indices.is_empty() {
            t.schema.clone()
        } else {
            Arc::new(t.schema.project(&indices)?)
        };
        let store = self.state.store().clone();
        let mut streams = Vec::with_capacity(files.len());
        for f in files {
            let reader = ObjectReader::new(store.clone(), f.object.clone())
                .with_metadata(f.metadata.metadata().clone());
            let mask = if indices.is_empty() {
                ProjectionMask::all()
            } else {
                ProjectionMask::roots(
                    f.metadata.metadata().file_metadata().schema_descr(),
                    indices.iter().copied(),
                )
            };
            let mut b =
                ParquetRecordBatchStreamBuilder::new_with_metadata(reader, f.metadata.clone())
                    .with_projection(mask)
                    .with_batch_size(SCAN_BATCH_ROWS);
            if let Some(n) = limit {
                // Each file decodes no more than the whole scan may return.
                b = b
                    .with_limit(n as usize)
                    .with_batch_size(SCAN_BATCH_ROWS.min(n.max(1) as usize));
            }
            streams.push(b.build()?);
        }
        let mut left = limit.unwrap_or(u64::MAX);
        let piece = self.state.wire_piece;
        let batches = futures::stream::iter(streams)
            .flatten()
            .try_take_while(move |_| futures::future::ready(Ok(left > 0)))
            .map_ok(move |b| {
                let take = (b.num_rows() as u64).min(left);
                left -= take;
                b.slice(0, take as usize)
            })
            .map_err(|e| FlightError::ExternalError(Box::new(Error::from(e))))
            .map_ok(move |b| {
                let pieces = crate::operator::wire_pieces(b, piece);
                futures::stream::iter(pieces.into_iter().map(Ok::<_, FlightError>))
            })
            .try_flatten();
        let encoder = FlightDataEncoderBuilder::new()
            .with_max_flight_data_size(ENCODER_LIMIT)
            .with_options(IpcWriteOptions::default().try_with_compression(compression)?)
            .with_schema(schema)
            .build(batches);
        Ok(self.run_stream(encoder))
    }

    pub(super) fn range(
        &self,
        object: &str,
        offset: u64,
        length: u64,
    ) -> Result<BoxStream<'static, Result<FlightData, Status>>> {
        let store = self.state.store().clone();
        let info = store
            .get(object)
            .ok_or_else(|| Error::NotFound(format!("object {}", truncated(object))))?;
        let end = offset
            .checked_add(length)
            .filter(|&e| e <= info.len)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "range [{offset}, {offset}+{length}) is beyond the end of {} ({} bytes)",
                    truncated(object),
                    info.len
                ))
            })?;
        let sent = self.state.counters.bytes_sent.clone();
        let chunk = self.state.range_chunk;
        // Up to RANGE_READ_AHEAD chunk reads in flight, sent in order.
        let s = futures::stream::iter(
            (offset..end).step_by(usize::try_from(chunk).unwrap_or(usize::MAX)),
        )
        .map(move |pos| {
            let (store, info, sent) = (store.clone(), info.clone(), sent.clone());
            async move {
                let n = chunk.min(end - pos);
                let body = store
                    .read_object_range(&info, pos, n)
                    .await
                    .map_err(|e| e.to_status())?;
                sent.fetch_add(n, Ordering::Relaxed);
                Ok(FlightData {
                    data_body: body,
                    ..Default::default()
                })
            }
        })
        .buffered(RANGE_READ_AHEAD);
        Ok(s.boxed())
    }
}
