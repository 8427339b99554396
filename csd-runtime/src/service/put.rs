//! `DoPut`: an Arrow stream stored as one new Parquet object of a table's partition.
//!
//! Incoming messages are checked before arrow decodes them (`protocol::ipc`),
//! counted against the tenant's quota as they arrive, decoded on the RPC thread and
//! handed over a 2-slot channel to the writer on the CPU pool. An upload is stored
//! only if its stream ended cleanly, after its end marker when it promised one
//! ([`PUT_MARKED`]); a cut one stores nothing and its space comes back.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arrow::record_batch::RecordBatch;
use arrow_flight::FlightData;
use arrow_flight::error::FlightError;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tonic::{Status, Streaming};

use super::FlightNode;
use crate::auth::{Permission, Principal};
use crate::error::{Error, Result, truncated};
use crate::protocol::ipc::{PutDecoder, map_incoming};
use crate::protocol::{PUT_END, PUT_MARKED, PUT_OBJECT_COPY, PutSummary};

/// Where an upload goes, and what its tenant may still store.
struct Upload {
    table: String,
    partition: String,
    /// The client promised an end marker.
    marked: bool,
    /// The copies of the partition the client is storing on as many nodes.
    copies: crate::table::Copies,
    /// What its tenant stored before, when it has a quota.
    quota_stored: Option<u64>,
}

/// How long an upload waits for memory before it is refused.
pub(super) const UPLOAD_PATIENCE: Duration = Duration::from_secs(30);

/// Memory an upload holds: a sixteenth of the budget, between 4 and 64 MiB (its row
/// groups are cut to fit, see [`crate::table::TableStore::append_within`]).
pub(super) fn upload_memory(budget: u64) -> u64 {
    (budget / 16).clamp(4 << 20, 64 << 20)
}

impl FlightNode {
    /// Stores `input` for `who`, under one of its request slots.
    pub(super) async fn put(
        &self,
        mut input: Streaming<FlightData>,
        who: Principal,
    ) -> Result<PutSummary> {
        let _slot = who.request_slot()?;
        let first = input
            .message()
            .await
            .map_err(map_incoming)?
            .ok_or_else(|| Error::InvalidArgument("DoPut stream is empty".into()))?;
        if first.app_metadata.as_ref() == PUT_OBJECT_COPY {
            return self.put_object_copy(first, input, &who).await;
        }
        let upload = self.upload_of(&first, &who)?;
        // Its buffers fit in the memory budget beside everything else, or it waits
        // (refused before a batch is read if it waits too long).
        let memory = &self.state.node.memory;
        let held = memory
            .hold(upload_memory(memory.budget()), "an upload", UPLOAD_PATIENCE)
            .await?;
        let summary = self.store(upload, first, input, who, held.bytes()).await;
        drop(held);
        // An upload's buffers are freed now; give them back to the OS, off the RPC
        // threads, so the memory budget is held against what the node really uses.
        tokio::task::spawn_blocking(crate::memory::trim);
        let summary = summary?;
        tracing::info!(table = %summary.table, partition = %summary.partition, rows = summary.rows, bytes = summary.bytes, "stored");
        Ok(summary)
    }

    /// The upload the first message describes, checked: names, `write` permission,
    /// room in the tenant's quota.
    fn upload_of(&self, first: &FlightData, who: &Principal) -> Result<Upload> {
        let desc = first.flight_descriptor.as_ref().ok_or_else(|| {
            Error::InvalidArgument("the first DoPut message must carry a descriptor".into())
        })?;
        let (table, partition, copies, put) = match desc.path.as_slice() {
            [t] => (t.clone(), "0".to_string(), "1", None),
            [t, p] => (t.clone(), p.clone(), "1", None),
            [t, p, c] => (t.clone(), p.clone(), c.as_str(), None),
            [t, p, c, put] => (t.clone(), p.clone(), c.as_str(), Some(put.clone())),
            _ => {
                return Err(Error::InvalidArgument(
                    "DoPut descriptor must be the path [table], [table, partition], \
                     [table, partition, copies] or [table, partition, copies, put]"
                        .into(),
                ));
            }
        };
        if let Some(put) = &put
            && (put.is_empty()
                || put.len() > 64
                || !put.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'))
        {
            return Err(Error::InvalidArgument(format!(
                "DoPut put id {:?}: must be 1 to 64 letters, digits or '-'",
                truncated(put)
            )));
        }
        let copies = copies
            .parse::<u32>()
            .ok()
            .filter(|c| (1..=crate::protocol::MAX_COPIES).contains(c))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "DoPut copies {:?}: must be a number from 1 to {}",
                    truncated(copies),
                    crate::protocol::MAX_COPIES
                ))
            })?;
        crate::table::validate_table_name(&table)?;
        crate::table::validate_partition_name(&partition)?;
        self.check_table(who, Permission::Write, &table)?;
        let quota = who.tenant().and_then(|t| t.max_stored_bytes).is_some();
        let quota_stored = quota.then(|| self.stored_by(who));
        who.check_stored(quota_stored.unwrap_or(0), 0)?;
        Ok(Upload {
            table,
            partition,
            marked: first.app_metadata.as_ref() == PUT_MARKED,
            copies: crate::table::Copies { copies, put },
            quota_stored,
        })
    }

    /// Decodes the stream (`first`, then `input`) and feeds the writer on the CPU
    /// pool; the object is stored only if the stream ended as it promised.
    async fn store(
        &self,
        upload: Upload,
        first: FlightData,
        input: Streaming<FlightData>,
        who: Principal,
        memory: u64,
    ) -> Result<PutSummary> {
        let closed = Arc::new(AtomicBool::new(false));
        let messages = futures::stream::once(async { Ok(first) }).chain(input);
        let incoming = self.checked(
            until_end(messages, upload.marked, closed.clone()),
            &upload,
            who,
        );
        let mut decoder = PutDecoder::new(incoming);
        let schema = decoder.schema().await?;
        let (tx, rx) = mpsc::channel::<Result<RecordBatch>>(2);
        // Set when the client's stream ended cleanly, after its end marker if it
        // promised one. Should the stream stop short of that (a reset, a dropped
        // handler, a missing marker), the writer sees its channel close without it
        // and abandons the object rather than storing a partial one.
        let ended = Arc::new(AtomicBool::new(false));
        let body = body_until_ended(rx, ended.clone());
        let state = self.state.clone();
        let (t, p, copies) = (
            upload.table.clone(),
            upload.partition.clone(),
            upload.copies.clone(),
        );
        let writer = state.node.pool.spawn({
            let state = state.clone();
            async move {
                state
                    .node
                    .tables
                    .append_within(&t, &p, schema, body, memory, copies)
                    .await
            }
        });
        let feed = async {
            while let Some(item) = decoder.next_batch().await {
                if let Ok(b) = &item {
                    self.state
                        .counters
                        .rows_received
                        .fetch_add(b.num_rows() as u64, Ordering::Relaxed);
                }
                let stop = item.is_err();
                if tx.send(item).await.is_err() || stop {
                    drop(tx);
                    return;
                }
            }
            // A client that promised an end marker and stopped short of it abandoned
            // the upload, however cleanly the transport ended.
            if !upload.marked || closed.load(Ordering::Acquire) {
                ended.store(true, Ordering::Release);
            }
            drop(tx);
        };
        // A failed upload's writer returns its space itself when dropped.
        let (_, summary) = futures::join!(feed, writer);
        summary
    }

    /// `messages`, counted and held against the tenant's quota as they arrive
    /// (the decoder checks each before arrow decodes it).
    fn checked(
        &self,
        messages: impl Stream<Item = Result<FlightData, Status>> + Send + 'static,
        upload: &Upload,
        who: Principal,
    ) -> impl Stream<Item = Result<FlightData, FlightError>> + Send + 'static {
        let state = self.state.clone();
        let quota_stored = upload.quota_stored;
        let mut received = 0u64;
        messages.map(move |m| {
            let m = m.map_err(|s| FlightError::Tonic(Box::new(s)))?;
            let bytes = (m.data_body.len() + m.data_header.len()) as u64;
            if let Some(stored) = quota_stored {
                // Arrow bytes received: the stored Parquet is rarely larger.
                received += bytes;
                who.check_stored(stored, received)
                    .map_err(|e| FlightError::ExternalError(Box::new(e)))?;
            }
            state
                .counters
                .bytes_received
                .fetch_add(bytes, Ordering::Relaxed);
            Ok(m)
        })
    }
}

/// `messages` up to a marked upload's end marker (taken out; `closed` is set when
/// it is seen); anything after it is refused.
fn until_end(
    messages: impl Stream<Item = Result<FlightData, Status>> + Send + 'static,
    marked: bool,
    closed: Arc<AtomicBool>,
) -> impl Stream<Item = Result<FlightData, Status>> + Send + 'static {
    messages.filter_map(move |m| {
        let end = matches!(&m, Ok(m) if marked
            && m.app_metadata.as_ref() == PUT_END
            && m.data_header.is_empty()
            && m.data_body.is_empty());
        let after_end = closed.load(Ordering::Acquire);
        if end {
            closed.store(true, Ordering::Release);
        }
        futures::future::ready(match m {
            _ if after_end => Some(Err(Status::invalid_argument(
                "DoPut sent messages after its end marker",
            ))),
            _ if end => None,
            m => Some(m),
        })
    })
}

/// The batches the writer stores: `rx`'s, then a failure unless `ended` says the
/// stream ended as it promised.
fn body_until_ended(
    rx: mpsc::Receiver<Result<RecordBatch>>,
    ended: Arc<AtomicBool>,
) -> BoxStream<'static, Result<RecordBatch>> {
    tokio_stream::wrappers::ReceiverStream::new(rx)
        .chain(
            futures::stream::once(async move {
                (!ended.load(Ordering::Acquire)).then(|| {
                    Err(Error::InvalidArgument(
                        "the DoPut stream was cut off before its end; nothing was stored".into(),
                    ))
                })
            })
            .filter_map(|x| async move { x }),
        )
        .boxed()
}
