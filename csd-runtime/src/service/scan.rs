//! Raw reads: a table's (or partition's, or kept result's) Parquet objects decoded
//! and streamed as Arrow IPC (`Scan`, `Ref`), and an object's bytes streamed as they
//! are stored (`Range`: the compute tier's own Parquet reads, and handed-back work).
//! Both run under a raw-read permit, never under operator admission, and hold the
//! memory their read-ahead and encoding take in the node's budget while they stream
//! ([`MemoryLedger::hold`](crate::memory::MemoryLedger::hold)).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use arrow::datatypes::SchemaRef;
use arrow::ipc::writer::IpcWriteOptions;
use arrow_flight::FlightData;
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use parquet::arrow::{ParquetRecordBatchStreamBuilder, ProjectionMask};
use tonic::Status;

use super::FlightNode;
use super::answer_codec::Behind;
use super::stream::{ENCODER_LIMIT, TaskStream};
use crate::admission::ReadPermit;
use crate::error::{Error, Result, truncated};
use crate::memory::Held;
use crate::protocol::Compression;
use crate::protocol::bodies;
use crate::table::{ObjectReader, ParquetObject};

/// Chunk reads a range stream keeps in flight.
const RANGE_READ_AHEAD: usize = 4;
/// Rows per Arrow batch a scan produces.
const SCAN_BATCH_ROWS: usize = 8192;
/// Encoded messages a stream keeps ready ahead of the client (see `run_stream`).
const STREAM_AHEAD: u64 = 4;
/// How long a raw read waits for memory before it is refused with a retry hint.
const READ_PATIENCE: Duration = Duration::from_secs(10);

/// A scan, resolved: the objects it reads, the columns (sorted file indices) and
/// the schema it answers in.
pub(super) struct ScanRequest {
    files: Vec<ParquetObject>,
    indices: Vec<usize>,
    schema: SchemaRef,
    skip: u64,
    limit: Option<u64>,
}

/// What a raw read holds while it streams: its read slot and its memory.
pub(super) struct ReadSlot {
    _permit: ReadPermit,
    _memory: Held,
}

impl FlightNode {
    /// A raw-read slot and `memory` bytes of the budget: bounded, waited for, and
    /// refused with a retry hint only when saturated or out of patience.
    pub(super) async fn read_slot(&self, memory: u64, what: &str) -> Result<ReadSlot> {
        let permit = self.state.admission.read().await.map_err(|r| Error::Busy {
            reason: r.reason,
            retry_after: r.retry_after,
        })?;
        let memory = self
            .state
            .node
            .memory
            .hold(memory, what, READ_PATIENCE)
            .await?;
        Ok(ReadSlot {
            _permit: permit,
            _memory: memory,
        })
    }

    /// Memory a scan holds: the largest row group's projected column chunks (read
    /// whole, then decoded batch by batch), a batch, and the encoded messages ready
    /// ahead of the client.
    pub(super) fn scan_memory(&self, r: &ScanRequest) -> u64 {
        let largest = r
            .files
            .iter()
            .flat_map(|f| {
                let meta = f.metadata.metadata();
                let descr = meta.file_metadata().schema_descr();
                meta.row_groups().iter().map(move |rg| {
                    let projected: i64 = rg
                        .columns()
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| {
                            r.indices.is_empty()
                                || r.indices.contains(&descr.get_column_root_idx(*i))
                        })
                        .map(|(_, c)| c.compressed_size().max(0))
                        .sum();
                    projected.max(0) as u64
                })
            })
            .max()
            .unwrap_or(0);
        let piece = self.state.wire_piece;
        largest + (STREAM_AHEAD + 1) * piece + (1 << 20)
    }

    /// The objects, columns and schema of a scan of `table` (one `partition`, or
    /// all), checked.
    pub(super) fn scan_request(
        &self,
        table: &str,
        partition: Option<&str>,
        columns: &[String],
        skip: u64,
        limit: Option<u64>,
    ) -> Result<ScanRequest> {
        let t = self.state.node.tables.table(table)?;
        let files: Vec<ParquetObject> = t.objects_of(partition.as_slice())?;
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
        Ok(ScanRequest {
            files,
            indices,
            schema,
            skip,
            limit,
        })
    }

    /// Streams `request`'s batches as Arrow IPC, `compression` on their bodies.
    pub(super) fn scan(
        &self,
        request: ScanRequest,
        compression: Option<arrow::ipc::CompressionType>,
    ) -> Result<TaskStream> {
        let ScanRequest {
            files,
            indices,
            schema,
            mut skip,
            limit,
        } = request;
        let store = self.state.store().clone();
        let mut streams = Vec::with_capacity(files.len());
        for f in files {
            // Whole files inside the rows skipped are not opened; the first file
            // past them skips the rest of its rows in its row selection.
            let rows = f.metadata.metadata().file_metadata().num_rows().max(0) as u64;
            if skip >= rows {
                skip -= rows;
                continue;
            }
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
            if skip > 0 {
                b = b.with_offset(skip as usize);
                skip = 0;
            }
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

    /// Memory a range stream of `length` bytes holds: its chunk reads in flight and
    /// the one being sent.
    pub(super) fn range_memory(&self, length: u64) -> u64 {
        length.min((RANGE_READ_AHEAD as u64 + 1) * self.state.range_chunk)
    }

    /// Streams bytes `[offset, offset + length)` of `object`, a chunk a message; with
    /// a `compression`, each chunk that shrinks goes compressed (compressed on the CPU
    /// pool; see [`crate::protocol::bodies`]); with `Auto`, zstd while the network
    /// finds chunks waiting, else LZ4 (see [`Behind`]).
    pub(super) fn range(
        &self,
        object: &str,
        offset: u64,
        length: u64,
        compression: Compression,
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
        let node = self.state.node.clone();
        let behind = (compression == Compression::Auto).then(Behind::default);
        let gauge = behind.clone();
        // Up to RANGE_READ_AHEAD chunk reads in flight, sent in order.
        let s = futures::stream::iter(
            (offset..end).step_by(usize::try_from(chunk).unwrap_or(usize::MAX)),
        )
        .map(move |pos| {
            let (store, info, sent) = (store.clone(), info.clone(), sent.clone());
            let (node, behind) = (node.clone(), behind.clone());
            async move {
                let n = chunk.min(end - pos);
                let body = store
                    .read_object_range(&info, pos, n)
                    .await
                    .map_err(|e| e.to_status())?;
                let compression = match &behind {
                    Some(b) => b.codec().compression(),
                    None => compression,
                };
                let packed = match compression {
                    Compression::None => None,
                    c => {
                        let raw = body.clone();
                        node.pool
                            .spawn(async move { Ok(bodies::compress(c, &raw)) })
                            .await
                            .map_err(|e| e.to_status())?
                    }
                };
                let d = match packed {
                    Some((packed, codec)) => FlightData {
                        data_body: packed.into(),
                        app_metadata: Bytes::from_static(codec),
                        ..Default::default()
                    },
                    None => FlightData {
                        data_body: body,
                        ..Default::default()
                    },
                };
                sent.fetch_add(d.data_body.len() as u64, Ordering::Relaxed);
                Ok(d)
            }
        })
        .buffered(RANGE_READ_AHEAD);
        Ok(match gauge {
            Some(g) => g.watch(s.boxed()).boxed(),
            None => s.boxed(),
        })
    }
}
