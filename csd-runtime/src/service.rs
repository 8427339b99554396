//! The Arrow Flight service of a storage node.
//!
//! | RPC | what it does |
//! |---|---|
//! | `DoPut` | descriptor path `[table]` or `[table, partition]` (default partition `0`): stores the Arrow stream as one new Parquet object; answers a `PutResult` whose metadata is the JSON [`PutSummary`](crate::protocol::PutSummary) |
//! | `ListFlights` | one `FlightInfo` per table (criteria expression: optional name prefix): schema, rows, bytes, one endpoint per partition with its scan ticket; `app_metadata` is JSON [`TableDescription`] |
//! | `GetFlightInfo` / `GetSchema` | the same for one table (descriptor path `[table]`) |
//! | `DoGet` | a [`Ticket`]: `Scan` streams Arrow batches; `Range` streams raw object bytes in `data_body` chunks; `Operator` runs a registered [`Operator`](crate::operator::Operator) and streams its batches, then an [`OperatorReport`](crate::protocol::OperatorReport) |
//! | `DoAction` | `stats` (JSON node figures), `delete` (body `table` or `table/partition`), `objects` (body: name prefix) |
//!
//! Errors become gRPC statuses only through [`Error::to_status`].

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Instant;

use crate::protocol::ipc::{check_message, map_incoming, next_decoded};
use arrow::datatypes::SchemaRef;
use arrow::ipc::writer::IpcWriteOptions;
use arrow_flight::decode::{DecodedPayload, FlightDataDecoder};
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_server::FlightService;
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightEndpoint, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaAsIpc, SchemaResult,
    Ticket as FlightTicket,
};
use base64::Engine as _;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt, TryStreamExt};
use parquet::arrow::{ParquetRecordBatchStreamBuilder, ProjectionMask};
use prost::Message as _;
use serde::Serialize;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};

use crate::admission::{Ask, Asker, ReadPermit, Refusal};
use crate::auth::{AUTHORIZATION, Credential, Permission, Principal};
use crate::error::{Error, Result, truncated};
use crate::operator::{OperatorContext, RequestMetrics};
use crate::pool::AbortOnDrop;
use crate::protocol::OperatorReport;
use crate::protocol::actions::ACTIONS;
use crate::protocol::{
    ActionRequest, Compression, DeleteRequest, DeleteResponse, ObjectDescription, ObjectsRequest,
    PartitionDescription, RefsRequest, ReleaseRequest, StatsRequest, TENANT_METADATA,
    TableDescription, Ticket,
};
use crate::state::NodeState;
use crate::table::{ObjectReader, ParquetObject, Table};

/// The Flight encoder's own split limit, well above the node's `--wire-piece`:
/// batches arrive already cut by [`crate::operator::wire_pieces`], and the encoder,
/// which measures buffer capacity, would otherwise cut slices again.
const ENCODER_LIMIT: usize = crate::protocol::MAX_MESSAGE_BYTES / 4;

/// The `csd-lease` header of a request (lease ids, comma-separated), if any.
fn lease_header(m: &tonic::metadata::MetadataMap) -> Option<String> {
    m.get(crate::protocol::LEASE_METADATA)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.chars().take(4096).collect::<String>())
        .filter(|v| !v.trim().is_empty())
}

/// What an operator request runs under: admission's permit, or a lease's slot.
enum Slot {
    /// Admission's permit and one of the tenant's request slots (`max_requests`;
    /// a lease holds its own).
    Admitted {
        permit: crate::admission::Permit,
        _request: crate::auth::RequestSlot,
    },
    Leased(crate::lease::LeaseRun),
}

impl Slot {
    /// Marks it run to completion (an admitted request's time teaches the cost model).
    fn complete(&mut self) {
        if let Slot::Admitted { permit, .. } = self {
            permit.complete();
        }
    }

    fn lease(&self) -> Option<&str> {
        match self {
            Slot::Leased(l) => Some(l.id()),
            Slot::Admitted { .. } => None,
        }
    }
}

/// `stream`, holding `permit` until it ends or is dropped.
fn holding<S, T, G>(stream: S, permit: G) -> BoxStream<'static, T>
where
    S: Stream<Item = T> + Send + 'static,
    G: Send + 'static,
{
    stream
        .map(move |item| {
            let _held = &permit;
            item
        })
        .boxed()
}

/// `stream`'s bodies counted as one transfer on `link` (ended when it is dropped).
fn metered(
    stream: BoxStream<'static, Result<FlightData, Status>>,
    link: Arc<crate::link::LinkMeter>,
) -> BoxStream<'static, Result<FlightData, Status>> {
    let transfer = link.transfer();
    stream
        .inspect(move |d| {
            if let Ok(d) = d {
                transfer.add(d.data_body.len() as u64);
            }
        })
        .boxed()
}

/// The tenant a request names: up to 64 of `[A-Za-z0-9_.-]`.
fn tenant_of(meta: &tonic::metadata::MetadataMap) -> Result<String> {
    let Some(v) = meta.get(TENANT_METADATA) else {
        return Ok(crate::admission::DEFAULT_TENANT.into());
    };
    let t = v.to_str().unwrap_or("");
    let ok = !t.is_empty()
        && t.len() <= 64
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
    if !ok {
        return Err(Error::InvalidArgument(format!(
            "{TENANT_METADATA} must be 1 to 64 letters, digits, '_', '.' or '-'"
        )));
    }
    Ok(t.to_string())
}

/// Chunk reads a range stream keeps in flight.
const RANGE_READ_AHEAD: usize = 4;
/// Rows per Arrow batch a scan produces.
const SCAN_BATCH_ROWS: usize = 8192;

/// The Flight service.
#[derive(Clone)]
pub(crate) struct FlightNode {
    state: Arc<NodeState>,
}

impl FlightNode {
    /// Serves `state`.
    pub(crate) fn new(state: Arc<NodeState>) -> Self {
        FlightNode { state }
    }

    /// Who `request` is: the tenant its token (or client certificate) proves when
    /// the node has tenants, else the one it names.
    fn who<T>(&self, request: &Request<T>) -> Result<Principal> {
        let meta = request.metadata();
        let auth = &self.state.auth;
        if !auth.enabled() {
            return auth.principal(None, None, &tenant_of(meta)?);
        }
        let certs = request.peer_certs();
        let cert = certs.as_ref().and_then(|c| c.first()).map(|c| c.as_ref());
        auth.principal(meta.get(AUTHORIZATION).map(|v| v.as_bytes()), cert, "")
    }

    /// A ticket to hand out to `who`: sealed (bound to its tenant, expiring) when the
    /// node has tenants.
    fn ticket_for(&self, who: &Principal, ticket: &Ticket) -> Vec<u8> {
        match who.tenant() {
            Some(_) => {
                self.state
                    .ticket_key
                    .seal(ticket.encode(), who.name(), self.state.ticket_ttl)
            }
            None => ticket.encode(),
        }
    }

    /// `Ok` if `who` may read raw bytes of `object`: an object of a table it may
    /// read, or any table's with `admin`. The node's own objects are never served.
    fn check_range(&self, who: &Principal, object: &str) -> Result<()> {
        match crate::table::parse_object_name(object) {
            Some((table, _, _)) if crate::refs::is_ref_table(table) => {
                self.check_table(who, Permission::Read, table)
            }
            _ => who.check_object_read(object),
        }
    }

    fn flight_info(&self, t: &Table, who: &Principal) -> Result<FlightInfo> {
        let desc = TableDescription {
            table: t.name.clone(),
            partitions: t
                .partitions
                .iter()
                .map(|(name, objects)| PartitionDescription {
                    name: name.clone(),
                    rows: objects.iter().map(ParquetObject::rows).sum(),
                    bytes: objects.iter().map(|o| o.object.len).sum(),
                    objects: objects
                        .iter()
                        .map(|o| ObjectDescription {
                            name: o.object.name.clone(),
                            len: o.object.len,
                            rows: o.rows(),
                            row_groups: o.metadata.metadata().num_row_groups(),
                            int_ranges: o.int_ranges(),
                        })
                        .collect(),
                })
                .collect(),
        };
        let mut info = FlightInfo::new()
            .try_with_schema(&t.schema)?
            .with_descriptor(FlightDescriptor::new_path(vec![t.name.clone()]))
            .with_total_records(t.rows() as i64)
            .with_total_bytes(t.bytes() as i64)
            .with_app_metadata(
                serde_json::to_vec(&desc).map_err(|e| Error::Internal(e.to_string()))?,
            );
        for p in t.partitions.keys() {
            let ticket = Ticket::Scan {
                table: t.name.clone(),
                partition: Some(p.clone()),
                columns: vec![],
                limit: None,
            };
            info = info.with_endpoint(
                FlightEndpoint::new()
                    .with_ticket(FlightTicket::new(self.ticket_for(who, &ticket)))
                    .with_location(self.state.location.clone())
                    .with_app_metadata(p.clone()),
            );
        }
        Ok(info)
    }

    fn table_of(desc: &FlightDescriptor) -> Result<String> {
        match desc.path.as_slice() {
            [t] => Ok(t.clone()),
            _ => Err(Error::InvalidArgument(
                "descriptor must be a path naming one table".into(),
            )),
        }
    }

    fn scan(
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

    /// Drives `stream` on the CPU pool, forwarding items through a small channel.
    fn run_stream<S>(&self, stream: S) -> TaskStream
    where
        S: Stream<Item = Result<FlightData, FlightError>> + Send + 'static,
        S: Unpin,
    {
        self.run_stream_then(stream, |_| None)
    }

    /// Like [`run_stream`](Self::run_stream); after the last item (if all went well)
    /// sends `trailer(bytes sent)` when that gives a message.
    fn run_stream_then<S, T>(&self, stream: S, trailer: T) -> TaskStream
    where
        S: Stream<Item = Result<FlightData, FlightError>> + Send + 'static,
        S: Unpin,
        T: FnOnce(u64) -> Option<FlightData> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel(4);
        let task = self.state.node.pool.spawn(async move {
            forward(stream, &tx, trailer).await;
            Ok(())
        });
        TaskStream {
            rx,
            _task: task,
            sent: self.state.counters.bytes_sent.clone(),
            _waiting: None,
        }
    }

    /// A raw-read slot: bounded, refused with a retry hint only when saturated.
    async fn read_permit(&self) -> Result<ReadPermit> {
        self.state.admission.read().await.map_err(|r| Error::Busy {
            reason: r.reason,
            retry_after: r.retry_after,
        })
    }

    /// Runs a pushed-down operator: plans on the CPU pool (a bad request fails the
    /// call itself), then streams its batches and the trailing [`OperatorReport`].
    #[allow(clippy::too_many_arguments)]
    async fn operator(
        &self,
        name: &str,
        args: Bytes,
        compression: Compression,
        principal: Principal,
        tenant: String,
        patient: bool,
        asker: Asker,
        lease: Option<String>,
    ) -> Result<TaskStream> {
        let started = Instant::now();
        let op = self.state.operators.get(name).cloned().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "operator {:?} is not served by this node (it serves: {})",
                truncated(name),
                self.state.operators.names().join(", ")
            ))
        })?;
        let metrics = Arc::new(RequestMetrics::default());
        let cancelled = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // Dropped with this handler, or with the answer's stream once it is returned.
        let waiting = crate::operator::CancelOnDrop(cancelled.clone());
        let ctx = OperatorContext {
            node: self.state.node.clone(),
            metrics: metrics.clone(),
            principal,
            cancelled,
        };
        // Estimated (and malformed arguments refused) before the request can queue.
        let estimate = op.estimate(&ctx, &args).await?;
        // A request naming a lease of its tenant runs on it, without queueing.
        let leased = match &lease {
            Some(ids) => {
                self.state
                    .leases
                    .run_on(
                        &self.state.admission,
                        ids,
                        Self::ref_owner(&ctx.principal),
                        estimate.memory,
                    )
                    .await?
            }
            None => None,
        };
        let mut kept_for_link = false;
        let mut predicted = std::time::Duration::ZERO;
        let (mut permit, waited, estimated, queue_reason) = match leased {
            Some(run) => {
                let waited = run.waited;
                (Slot::Leased(run), waited, std::time::Duration::ZERO, None)
            }
            None => {
                let request = ctx.principal.request_slot()?;
                let ask = Ask {
                    operator: op.cost_key(&args).unwrap_or_else(|| name.to_string()),
                    tenant,
                    bytes: estimate.bytes,
                    memory: estimate.memory,
                    patient,
                    asker,
                    shape: estimate.shape,
                };
                let permit = self.state.admission.admit(ask).await.map_err(|r| match r {
                    Refusal::PushBack(p) => Error::PushedBack(p),
                    Refusal::Reject(r) => Error::Busy {
                        reason: r.reason,
                        retry_after: r.retry_after,
                    },
                })?;
                let (waited, estimated) = (permit.waited, permit.estimate);
                predicted = permit.predicted;
                kept_for_link = permit.kept_for_link;
                let why =
                    self.state
                        .admission
                        .why_waited(waited, estimated, patient, kept_for_link);
                let slot = Slot::Admitted {
                    permit,
                    _request: request,
                };
                (slot, waited, estimated, why)
            }
        };
        let lease_id = permit.lease().map(str::to_string);
        let piece = self.state.wire_piece;
        let name = name.to_string();
        let options = IpcWriteOptions::default().try_with_compression(match compression {
            Compression::None => None,
            Compression::Lz4Frame => Some(arrow::ipc::CompressionType::LZ4_FRAME),
            Compression::Zstd => Some(arrow::ipc::CompressionType::ZSTD),
        })?;
        // Ran to the end: its time teaches the cost model; the slot is freed here.
        let trailer = move |bytes_sent: u64, rows: u64| {
            permit.complete();
            drop(permit);
            let mut details: BTreeMap<String, String> = metrics
                .details
                .lock()
                .map(|d| d.clone())
                .unwrap_or_default();
            details.extend(
                [
                    ("queue_ms", waited.as_secs_f64() * 1e3),
                    ("predicted_queue_ms", predicted.as_secs_f64() * 1e3),
                    ("estimate_ms", estimated.as_secs_f64() * 1e3),
                    ("estimate_bytes", estimate.bytes as f64),
                    ("patient", f64::from(u8::from(patient))),
                    ("kept_for_link", f64::from(u8::from(kept_for_link))),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_string(), format!("{v:.3}"))),
            );
            if let Some(why) = queue_reason {
                details.insert("queue_reason".into(), why);
            }
            if let Some(id) = lease_id {
                details.insert("lease".into(), id);
            }
            let report = OperatorReport {
                operator: name,
                bytes_read: metrics.bytes_read.load(Ordering::Relaxed),
                bytes_sent,
                rows_scanned: metrics.rows_scanned.load(Ordering::Relaxed),
                rows_returned: rows,
                elapsed_us: started.elapsed().as_micros() as u64,
                details,
            };
            let json = serde_json::to_vec(&report).ok()?;
            Some(FlightData::new().with_app_metadata(json))
        };
        // One task on the CPU pool opens the operator and streams its batches; this
        // handler waits only for the open's outcome (a bad request fails the call
        // itself), not for a second hop onto the pool.
        let (opened_tx, opened_rx) = tokio::sync::oneshot::channel::<Result<()>>();
        let (tx, rx) = mpsc::channel(4);
        let task = self.state.node.pool.spawn(async move {
            let opened = match op.open(ctx, args).await {
                Ok(o) => o,
                Err(e) => {
                    let _ = opened_tx.send(Err(e));
                    return Ok(());
                }
            };
            let _ = opened_tx.send(Ok(()));
            let rows = Arc::new(AtomicU64::new(0));
            let batches = opened
                .batches
                .map({
                    let rows = rows.clone();
                    move |b| match b {
                        Ok(b) => {
                            rows.fetch_add(b.num_rows() as u64, Ordering::Relaxed);
                            let pieces = crate::operator::wire_pieces(b, piece);
                            Ok(futures::stream::iter(pieces.into_iter().map(Ok)))
                        }
                        Err(e) => Err(FlightError::ExternalError(Box::new(e))),
                    }
                })
                .try_flatten();
            let encoder = FlightDataEncoderBuilder::new()
                .with_max_flight_data_size(ENCODER_LIMIT)
                .with_options(options)
                .with_schema(opened.schema)
                .build(batches);
            forward(encoder, &tx, |sent| {
                trailer(sent, rows.load(Ordering::Relaxed))
            })
            .await;
            Ok(())
        });
        match opened_rx.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            // The task ended without a word: it panicked (or the pool is stopping).
            Err(_) => {
                task.await?;
                return Err(Error::Internal("the operator's task ended early".into()));
            }
        }
        Ok(TaskStream {
            rx,
            _task: task,
            sent: self.state.counters.bytes_sent.clone(),
            _waiting: Some(waiting),
        })
    }

    fn range(
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

    /// An operator request from `who`: its permissions checked, the asker's figures
    /// completed with what this node learned of its link, then run.
    #[allow(clippy::too_many_arguments)]
    async fn operator_request(
        &self,
        who: &Principal,
        peer: Option<std::net::IpAddr>,
        tenant: String,
        name: String,
        args: Vec<u8>,
        compression: Compression,
        patient: bool,
        asker: Option<crate::protocol::AskerFigures>,
        lease: Option<String>,
    ) -> Result<TaskStream> {
        if let Some(op) = self.state.operators.get(&name) {
            let args = Bytes::copy_from_slice(&args);
            if who.tenant().is_some() && op.ships_code(&args) {
                who.check_any(Permission::Code, "run code it ships (WebAssembly)")?;
            }
            for t in op.tables(&args)? {
                if who.tenant().is_some() || crate::refs::is_ref_table(&t) {
                    self.check_table(who, Permission::Read, &t)?;
                }
            }
        }
        // The asker's own figures first; else what this node learned of its link.
        let known = |v: f64| (v > 0.0).then_some(v);
        let link = asker
            .and_then(|a| known(a.link_bytes_per_s))
            .or_else(|| peer.and_then(|p| self.state.links.bytes_per_sec(p)));
        // What this node handed back to that link lately and it has not carried yet.
        let meter = peer.zip(link).map(|(p, l)| (self.state.links.of(p), l));
        let asker = Asker {
            link_bytes_per_s: link,
            ns_per_byte: asker.and_then(|a| known(a.ns_per_byte)),
            load: asker.map(|a| a.load).unwrap_or(0.0),
            backlog_bytes: meter.as_ref().map_or(0, |(m, l)| m.backlog(*l)),
        };
        let answer = self
            .operator(
                &name,
                args.into(),
                compression,
                who.clone(),
                tenant,
                patient,
                asker,
                lease,
            )
            .await;
        if let (Err(Error::PushedBack(p)), Some((m, l))) = (&answer, &meter) {
            m.handed_back(p.bytes, *l);
        }
        answer
    }

    /// Whose references `who` may use: its own when the node has tenants (all, for
    /// an admin); on an open node a reference's ticket is the capability.
    fn ref_owner(who: &Principal) -> Option<&str> {
        match who.tenant() {
            Some(t) if !t.has(Permission::Admin) => Some(who.name()),
            _ => None,
        }
    }

    /// The endpoint of a kept result for tenant `holder` (its owner or a grantee): a
    /// `Ref` ticket (sealed for `holder` when the node has tenants, the seal lasting
    /// as long as the reference does, renewals included), this node, and the
    /// reference's expiry.
    fn ref_endpoint(&self, holder: &str, r: &crate::refs::RefInfo) -> FlightEndpoint {
        let ticket = Ticket::Ref { id: r.id.clone() }.encode();
        let ticket = match self.state.auth.enabled() {
            true => self.state.ticket_key.seal_until(ticket, holder, u64::MAX),
            false => ticket,
        };
        FlightEndpoint::new()
            .with_ticket(FlightTicket::new(ticket))
            .with_location(self.state.location.clone())
            .with_expiration_time(crate::refs::timestamp(r.expires_unix_ms))
            .with_app_metadata(r.table.clone())
    }

    /// A kept result as `refs` and `grant` describe it, with its ticket for `holder`.
    fn ref_description(
        &self,
        holder: &str,
        r: &crate::refs::RefInfo,
    ) -> crate::protocol::actions::RefDescription {
        crate::protocol::actions::RefDescription {
            info: r.clone(),
            ticket: base64::engine::general_purpose::STANDARD.encode(
                self.ref_endpoint(holder, r)
                    .ticket
                    .map(|t| t.ticket)
                    .unwrap_or_default(),
            ),
            location: self.state.location.clone(),
        }
    }

    /// `GetFlightInfo` with a command: runs the operator ticket in it and keeps its
    /// answer at the node (see [`crate::refs`]).
    async fn keep(
        &self,
        who: Principal,
        peer: Option<std::net::IpAddr>,
        cmd: &[u8],
        lease: Option<String>,
    ) -> Result<FlightInfo> {
        let (ticket, seal) = Ticket::decode_sealed(cmd)?;
        if let Some(seal) = &seal {
            self.state.ticket_key.verify(seal, &who)?;
        }
        let Ticket::Operator {
            name,
            args,
            compression,
            patient: _,
            asker,
            keep_ms: Some(keep_ms),
            keep_group,
        } = ticket
        else {
            return Err(Error::InvalidArgument(
                "a GetFlightInfo command must be an operator ticket with keep_ms (a result to keep); tables are described by a path descriptor".into(),
            ));
        };
        let ttl = self
            .state
            .refs
            .check_ttl(std::time::Duration::from_millis(keep_ms))?;
        let room = match who.tenant().and_then(|t| t.max_stored_bytes) {
            Some(limit) => {
                let stored = self.stored_by(&who);
                who.check_stored(stored, 1)?;
                Some(limit.saturating_sub(stored))
            }
            None => None,
        };
        let tenant = self.state.admission.bucket(who.name());
        // A kept result cannot be finished by the asker: it queues rather than being
        // handed back for queueing delay (memory still hands it back).
        let answer = self
            .operator_request(
                &who,
                peer,
                tenant,
                name.clone(),
                args,
                compression,
                true,
                asker,
                lease,
            )
            .await?;
        // The operator's encoded answer, decoded back to batches for the table (the
        // trailing report has no IPC header: it is taken out here).
        let report = Arc::new(std::sync::Mutex::new(None::<Bytes>));
        let data = answer.filter_map({
            let report = report.clone();
            move |d| {
                futures::future::ready(match d {
                    Ok(d) if d.data_header.is_empty() => {
                        if !d.app_metadata.is_empty()
                            && let Ok(mut r) = report.lock()
                        {
                            *r = Some(d.app_metadata.clone());
                        }
                        None
                    }
                    Ok(d) => Some(Ok(d)),
                    Err(s) => Some(Err(FlightError::Tonic(Box::new(s)))),
                })
            }
        });
        let mut decoded = FlightDataDecoder::new(data);
        let schema = loop {
            match decoded.next().await {
                Some(Ok(d)) => {
                    if let DecodedPayload::Schema(s) = d.payload {
                        break s;
                    }
                }
                Some(Err(e)) => return Err(flight_error(e)),
                None => {
                    return Err(Error::Internal(
                        "the operator's answer ended before its schema".into(),
                    ));
                }
            }
        };
        let batches = decoded
            .filter_map(|d| {
                futures::future::ready(match d {
                    Ok(d) => match d.payload {
                        DecodedPayload::RecordBatch(b) => Some(Ok(b)),
                        _ => None,
                    },
                    Err(e) => Some(Err(flight_error(e))),
                })
            })
            .boxed();
        let kept = self
            .state
            .refs
            .keep(
                &self.state.node.tables,
                who.name(),
                &name,
                keep_group.as_deref(),
                ttl,
                room,
                schema.clone(),
                batches,
            )
            .await?;
        tracing::info!(id = %kept.id, table = %kept.table, tenant = %kept.tenant, rows = kept.rows, bytes = kept.bytes, "result kept");
        let report = report.lock().ok().and_then(|mut r| r.take());
        let info = FlightInfo::new()
            .try_with_schema(&schema)?
            .with_endpoint(self.ref_endpoint(&kept.tenant, &kept))
            .with_total_records(kept.rows as i64)
            .with_total_bytes(kept.bytes as i64)
            .with_descriptor(FlightDescriptor::new_cmd(cmd.to_vec()))
            .with_app_metadata(report.unwrap_or_default());
        Ok(info)
    }

    /// The `invoke` action: a function of a shipped module on a lease's slot.
    async fn invoke(&self, who: &Principal, body: Bytes) -> Result<arrow_flight::Result> {
        let split = body.iter().position(|&b| b == b'\n').ok_or_else(|| {
            Error::InvalidArgument(
                "an invoke body is a JSON head, a newline, then Arrow IPC arguments".into(),
            )
        })?;
        let head: crate::protocol::InvokeRequest = serde_json::from_slice(&body[..split])
            .map_err(|e| Error::InvalidArgument(format!("the head of an invoke body: {e}")))?;
        let digest = crate::sandbox::ModuleDigest::parse(
            head.module
                .strip_prefix("sha256:")
                .unwrap_or(&head.module)
                .as_bytes(),
        )?;
        let sandbox = self.state.node.sandbox.clone();
        let module = sandbox.module(&digest, None).await?;
        let state = self.state.clone();
        let owner = Self::ref_owner(who).map(String::from);
        let slot = self
            .state
            .leases
            .slot(&head.lease, owner.as_deref())
            .await?;
        // On the lease's slot — a blocking thread, not the admitted work's pool nor
        // the RPC threads — with the arguments' decoding and the answer's encoding.
        let body = tokio::task::spawn_blocking(move || -> Result<Bytes> {
            let _slot = slot;
            let bad = |e: arrow::error::ArrowError| {
                Error::InvalidArgument(format!("invoke arguments: {e}"))
            };
            let mut r = arrow::ipc::reader::StreamReader::try_new(
                std::io::Cursor::new(body.slice(split + 1..)),
                None,
            )
            .map_err(bad)?;
            let args = match r.next() {
                Some(b) => b.map_err(bad)?,
                None => arrow::record_batch::RecordBatch::new_empty(r.schema()),
            };
            let (out, start) = state.leases.invoke(
                &sandbox,
                &module,
                &head.lease,
                owner.as_deref(),
                &head.export,
                &args,
            )?;
            let batch = arrow::record_batch::RecordBatch::try_from_iter([("out", out)])?;
            let mut reply = serde_json::to_vec(&serde_json::json!({ "start": start }))
                .map_err(|e| Error::Internal(e.to_string()))?;
            reply.push(b'\n');
            let mut w = arrow::ipc::writer::StreamWriter::try_new(reply, &batch.schema())?;
            w.write(&batch)?;
            w.finish()?;
            Ok(w.into_inner()?.into())
        })
        .await
        .map_err(|e| Error::Internal(format!("invocation thread: {e}")))??;
        Ok(arrow_flight::Result { body })
    }

    /// `Ok` if `who` may do `p` to `table`: the tenant's permissions, and for kept
    /// results' tables, reading only, by the tenant that kept them (or an admin).
    fn check_table(&self, who: &Principal, p: Permission, table: &str) -> Result<()> {
        if !crate::refs::is_ref_table(table) {
            return who.check(p, table);
        }
        if p != Permission::Read {
            return Err(who.refuse(format!(
                "table {} holds kept results: it is read-only (release them with the `release` action)",
                truncated(table)
            )));
        }
        self.state.refs.check_table(table, Self::ref_owner(who))
    }

    /// The kept result a ticket of an endpoint names (its seal checked for `who`).
    fn ref_of(&self, who: &Principal, ticket: &[u8]) -> Result<String> {
        let (t, seal) = Ticket::decode_sealed(ticket)?;
        if let Some(seal) = &seal {
            self.state.ticket_key.verify(seal, who)?;
        }
        match t {
            Ticket::Ref { id } => Ok(id),
            _ => Err(Error::InvalidArgument(
                "the endpoint's ticket is not a kept result's (only those can be renewed or released)".into(),
            )),
        }
    }

    /// Bytes stored now in the tables `who` may write and its kept results (its
    /// quota's measure).
    fn stored_by(&self, who: &Principal) -> u64 {
        self.state
            .node
            .tables
            .tables()
            .iter()
            .filter(|t| !crate::refs::is_ref_table(&t.name) && who.may(Permission::Write, &t.name))
            .map(Table::bytes)
            .sum::<u64>()
            + self.state.refs.bytes_of(who.name())
    }

    async fn put(
        &self,
        mut input: Streaming<FlightData>,
        who: Principal,
    ) -> Result<crate::protocol::PutSummary> {
        let first = input
            .message()
            .await
            .map_err(map_incoming)?
            .ok_or_else(|| Error::InvalidArgument("DoPut stream is empty".into()))?;
        let desc = first.flight_descriptor.clone().ok_or_else(|| {
            Error::InvalidArgument("the first DoPut message must carry a descriptor".into())
        })?;
        let (table, partition) = match desc.path.as_slice() {
            [t] => (t.clone(), "0".to_string()),
            [t, p] => (t.clone(), p.clone()),
            _ => {
                return Err(Error::InvalidArgument(
                    "DoPut descriptor must be the path [table] or [table, partition]".into(),
                ));
            }
        };
        crate::table::validate_table_name(&table)?;
        crate::table::validate_partition_name(&partition)?;
        self.check_table(&who, Permission::Write, &table)?;
        let quota = who.tenant().and_then(|t| t.max_stored_bytes).is_some();
        let stored = if quota { self.stored_by(&who) } else { 0 };
        who.check_stored(stored, 0)?;
        let mut upload = 0u64;
        let marked = first.app_metadata.as_ref() == crate::protocol::PUT_MARKED;
        let closed = Arc::new(AtomicBool::new(false));
        let state = self.state.clone();
        let incoming = futures::stream::once(async { Ok(first) })
            .chain(input)
            .filter_map({
                let closed = closed.clone();
                move |m| {
                    let end = matches!(&m, Ok(m) if marked
                        && m.app_metadata.as_ref() == crate::protocol::PUT_END
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
                }
            })
            .map(move |m| {
                let m = m.map_err(|s| FlightError::Tonic(Box::new(s)))?;
                check_message(&m).map_err(|e| FlightError::ExternalError(Box::new(e)))?;
                if quota {
                    // Arrow bytes received: the stored Parquet is rarely larger.
                    upload += (m.data_body.len() + m.data_header.len()) as u64;
                    who.check_stored(stored, upload)
                        .map_err(|e| FlightError::ExternalError(Box::new(e)))?;
                }
                state.counters.bytes_received.fetch_add(
                    (m.data_body.len() + m.data_header.len()) as u64,
                    Ordering::Relaxed,
                );
                Ok(m)
            });
        let mut decoder = FlightDataDecoder::new(incoming);
        // The schema message comes first.
        let schema = loop {
            match next_decoded(&mut decoder).await {
                Some(Ok(d)) => match d.payload {
                    DecodedPayload::Schema(s) => break s,
                    DecodedPayload::None => continue,
                    DecodedPayload::RecordBatch(_) => {
                        return Err(Error::InvalidArgument(
                            "DoPut sent a record batch before its schema".into(),
                        ));
                    }
                },
                Some(Err(e)) => return Err(e),
                None => {
                    return Err(Error::InvalidArgument(
                        "DoPut stream ended without a schema".into(),
                    ));
                }
            }
        };
        let (tx, rx) = mpsc::channel::<Result<arrow::record_batch::RecordBatch>>(2);
        // Set when the client's stream ended cleanly, after its end marker if it
        // promised one. Should the stream stop short of that (a reset, a dropped
        // handler, a missing marker), the writer sees its channel close without it
        // and abandons the object rather than storing a partial one.
        let ended = Arc::new(AtomicBool::new(false));
        let body = {
            let ended = ended.clone();
            tokio_stream::wrappers::ReceiverStream::new(rx)
                .chain(
                    futures::stream::once(async move {
                        (!ended.load(Ordering::Acquire)).then(|| {
                            Err(Error::InvalidArgument(
                                "the DoPut stream was cut off before its end; nothing was stored"
                                    .into(),
                            ))
                        })
                    })
                    .filter_map(|x| async move { x }),
                )
                .boxed()
        };
        let state = self.state.clone();
        let (t, p, s) = (table.clone(), partition.clone(), schema.clone());
        let writer = state.node.pool.spawn({
            let state = state.clone();
            async move { state.node.tables.append(&t, &p, s, body).await }
        });
        let feed = async {
            while let Some(d) = next_decoded(&mut decoder).await {
                let item = match d {
                    Ok(d) => match d.payload {
                        DecodedPayload::RecordBatch(b) => {
                            self.state
                                .counters
                                .rows_received
                                .fetch_add(b.num_rows() as u64, Ordering::Relaxed);
                            Ok(b)
                        }
                        DecodedPayload::None => continue,
                        DecodedPayload::Schema(_) => {
                            Err(Error::InvalidArgument("DoPut sent a second schema".into()))
                        }
                    },
                    Err(e) => Err(e),
                };
                let stop = item.is_err();
                if tx.send(item).await.is_err() || stop {
                    drop(tx);
                    return;
                }
            }
            // A client that promised an end marker and stopped short of it abandoned
            // the upload, however cleanly the transport ended.
            if !marked || closed.load(Ordering::Acquire) {
                ended.store(true, Ordering::Release);
            }
            drop(tx);
        };
        // A failed upload's writer returns its space itself when dropped.
        let (_, summary) = futures::join!(feed, writer);
        summary
    }
}

/// A response stream fed by a CPU-pool task, which is cancelled when the stream drops.
struct TaskStream {
    rx: mpsc::Receiver<Result<FlightData, Status>>,
    _task: AbortOnDrop<Result<()>>,
    sent: Arc<AtomicU64>,
    /// Tells the operator when the answer is no longer wanted.
    _waiting: Option<crate::operator::CancelOnDrop>,
}

impl Stream for TaskStream {
    type Item = Result<FlightData, Status>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let p = self.rx.poll_recv(cx);
        if let Poll::Ready(Some(Ok(d))) = &p {
            self.sent.fetch_add(
                (d.data_body.len() + d.data_header.len()) as u64,
                Ordering::Relaxed,
            );
        }
        p
    }
}

/// Sends `stream`'s items to `tx` until the receiver goes or an item fails; after
/// the last item (if all went well) sends `trailer(bytes sent)` when that gives a
/// message.
async fn forward<S, T>(mut stream: S, tx: &mpsc::Sender<Result<FlightData, Status>>, trailer: T)
where
    S: Stream<Item = Result<FlightData, FlightError>> + Unpin,
    T: FnOnce(u64) -> Option<FlightData>,
{
    let mut sent = 0u64;
    while let Some(item) = stream.next().await {
        let item = item.map_err(|e| Error::from(e).to_status());
        let stop = item.is_err();
        if let Ok(d) = &item {
            sent += (d.data_body.len() + d.data_header.len()) as u64;
        }
        if tx.send(item).await.is_err() || stop {
            return;
        }
    }
    if let Some(last) = trailer(sent) {
        let _ = tx.send(Ok(last)).await;
    }
}

type FlightStream<T> = BoxStream<'static, Result<T, Status>>;

fn one<T: Send + 'static>(item: T) -> Response<FlightStream<T>> {
    Response::new(futures::stream::once(async move { Ok(item) }).boxed())
}

fn json_result<T: Serialize>(v: &T) -> Result<arrow_flight::Result> {
    let body = serde_json::to_vec_pretty(v).map_err(|e| Error::Internal(e.to_string()))?;
    Ok(arrow_flight::Result { body: body.into() })
}

#[tonic::async_trait]
impl FlightService for FlightNode {
    type HandshakeStream = FlightStream<HandshakeResponse>;
    type ListFlightsStream = FlightStream<FlightInfo>;
    type DoGetStream = FlightStream<FlightData>;
    type DoPutStream = FlightStream<PutResult>;
    type DoActionStream = FlightStream<arrow_flight::Result>;
    type ListActionsStream = FlightStream<ActionType>;
    type DoExchangeStream = FlightStream<FlightData>;

    /// Flight's token handshake: `authorization: Basic base64(tenant:token)` (or a
    /// bearer token) in, the bearer token to send with every call out, in the
    /// `authorization` response header. Optional: tokens work without it.
    async fn handshake(
        &self,
        request: Request<Streaming<HandshakeRequest>>,
    ) -> Result<Response<Self::HandshakeStream>, Status> {
        let who = self.who(&request)?;
        let mut response = one(HandshakeResponse::default());
        if who.tenant().is_some() {
            let token = request
                .metadata()
                .get(AUTHORIZATION)
                .map(|v| crate::auth::parse_authorization(v.as_bytes()))
                .transpose()?
                .map(|c| match c {
                    Credential::Bearer(t) => t,
                    Credential::Basic { password, .. } => password,
                });
            if let Some(v) = token.and_then(|t| format!("Bearer {t}").parse().ok()) {
                response.metadata_mut().insert(AUTHORIZATION, v);
            }
        }
        Ok(response)
    }

    async fn list_flights(
        &self,
        request: Request<Criteria>,
    ) -> Result<Response<Self::ListFlightsStream>, Status> {
        let who = self.who(&request)?;
        let prefix = String::from_utf8(request.into_inner().expression.to_vec()).map_err(|_| {
            Error::InvalidArgument("criteria expression must be a UTF-8 table-name prefix".into())
        })?;
        let infos = self
            .state
            .node
            .tables
            .tables()
            .iter()
            .filter(|t| {
                t.name.starts_with(&prefix)
                    && if crate::refs::is_ref_table(&t.name) {
                        self.check_table(&who, Permission::Read, &t.name).is_ok()
                    } else {
                        who.may(Permission::Read, &t.name)
                    }
            })
            .map(|t| self.flight_info(t, &who).map_err(|e| e.to_status()))
            .collect::<Vec<_>>();
        Ok(Response::new(futures::stream::iter(infos).boxed()))
    }

    async fn get_flight_info(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let who = self.who(&request)?;
        if request.get_ref().r#type == arrow_flight::flight_descriptor::DescriptorType::Cmd as i32 {
            let peer = request.remote_addr().map(|a| a.ip());
            let cmd = request.get_ref().cmd.clone();
            let lease = lease_header(request.metadata());
            return Ok(Response::new(self.keep(who, peer, &cmd, lease).await?));
        }
        let table = Self::table_of(request.get_ref())?;
        self.check_table(&who, Permission::Read, &table)?;
        Ok(Response::new(self.flight_info(
            &self.state.node.tables.table(&table)?,
            &who,
        )?))
    }

    async fn poll_flight_info(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<PollInfo>, Status> {
        self.who(&request)?;
        Err(
            Error::Unimplemented("PollFlightInfo is not supported: use GetFlightInfo".into())
                .into(),
        )
    }

    async fn get_schema(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<SchemaResult>, Status> {
        let who = self.who(&request)?;
        let table = Self::table_of(request.get_ref())?;
        self.check_table(&who, Permission::Read, &table)?;
        let t = self.state.node.tables.table(&table)?;
        let r: SchemaResult = SchemaAsIpc::new(&t.schema, &IpcWriteOptions::default())
            .try_into()
            .map_err(|e: arrow::error::ArrowError| Error::from(e).to_status())?;
        Ok(Response::new(r))
    }

    async fn do_get(
        &self,
        request: Request<FlightTicket>,
    ) -> Result<Response<Self::DoGetStream>, Status> {
        self.state.counters.do_get.fetch_add(1, Ordering::Relaxed);
        let who = self.who(&request)?;
        let lease = lease_header(request.metadata());
        let tenant = self.state.admission.bucket(who.name());
        let peer = request.remote_addr().map(|a| a.ip());
        let (ticket, seal) = Ticket::decode_sealed(&request.get_ref().ticket)?;
        if let Some(seal) = &seal {
            self.state.ticket_key.verify(seal, &who)?;
        }
        // An operator request takes its request slot where it is admitted (on a
        // lease it runs within the slots the lease holds); the others here.
        let slot = match &ticket {
            Ticket::Operator { .. } => None,
            _ => Some(who.request_slot()?),
        };
        let stream = match ticket {
            Ticket::Operator {
                keep_ms: Some(_), ..
            } => {
                return Err(Error::InvalidArgument(
                    "an operator ticket with keep_ms asks to keep the result: send it as the command of GetFlightInfo, not to DoGet".into(),
                )
                .into());
            }
            Ticket::Operator {
                name,
                args,
                compression,
                patient,
                asker,
                keep_ms: None,
                keep_group: _,
            } => self
                .operator_request(
                    &who,
                    peer,
                    tenant,
                    name,
                    args,
                    compression,
                    patient,
                    asker,
                    lease,
                )
                .await?
                .boxed(),
            Ticket::Ref { id } => {
                let r = self.state.refs.get_readable(&id, Self::ref_owner(&who))?;
                let permit = self.read_permit().await?;
                // Kept results are read over links: LZ4, cheap and about 2x.
                let lz4 = Some(arrow::ipc::CompressionType::LZ4_FRAME);
                holding(self.scan(&r.table, Some(&r.id), &[], None, lz4)?, permit)
            }
            Ticket::Scan {
                table,
                partition,
                columns,
                limit,
            } => {
                self.check_table(&who, Permission::Read, &table)?;
                let permit = self.read_permit().await?;
                holding(
                    self.scan(&table, partition.as_deref(), &columns, limit, None)?,
                    permit,
                )
            }
            Ticket::Range {
                object,
                offset,
                length,
            } => {
                self.check_range(&who, &object)?;
                let permit = self.read_permit().await?;
                let stream = self.range(&object, offset, length)?;
                match peer {
                    Some(p) => holding(metered(stream, self.state.links.of(p)), permit),
                    None => holding(stream, permit),
                }
            }
        };
        Ok(Response::new(holding(stream, slot)))
    }

    async fn do_put(
        &self,
        request: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoPutStream>, Status> {
        self.state.counters.do_put.fetch_add(1, Ordering::Relaxed);
        let who = self.who(&request)?;
        let _slot = who.request_slot()?;
        let summary = self.put(request.into_inner(), who).await;
        // An upload's buffers are freed now; give them back to the OS, off the RPC
        // threads, so the memory budget is held against what the node really uses.
        tokio::task::spawn_blocking(crate::memory::trim);
        let summary = summary?;
        tracing::info!(table = %summary.table, partition = %summary.partition, rows = summary.rows, bytes = summary.bytes, "stored");
        let meta = serde_json::to_vec(&summary)
            .map_err(|e| Error::Internal(format!("put summary: {e}")))?;
        Ok(one(PutResult {
            app_metadata: meta.into(),
        }))
    }

    async fn do_exchange(
        &self,
        request: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoExchangeStream>, Status> {
        self.who(&request)?;
        Err(Error::Unimplemented("DoExchange is not supported".into()).into())
    }

    async fn do_action(
        &self,
        request: Request<Action>,
    ) -> Result<Response<Self::DoActionStream>, Status> {
        let who = self.who(&request)?;
        let action = request.into_inner();
        let body = &action.body;
        let result = match action.r#type.as_str() {
            StatsRequest::TYPE => {
                StatsRequest::decode(body)?;
                who.check_admin("read the node's figures (stats)")?;
                json_result(&self.state.stats().await)?
            }
            DeleteRequest::TYPE => {
                let r = DeleteRequest::decode(body)?;
                self.check_table(&who, Permission::Delete, &r.table)?;
                let n = self
                    .state
                    .node
                    .tables
                    .delete(&r.table, r.partition.as_deref())
                    .await?;
                json_result(&DeleteResponse {
                    deleted_objects: n as u64,
                })?
            }
            ObjectsRequest::TYPE => {
                let r = ObjectsRequest::decode(body)?;
                who.check_admin("list the node's objects")?;
                let list: <ObjectsRequest as ActionRequest>::Response = self
                    .state
                    .store()
                    .list(&r.prefix)
                    .iter()
                    .map(|o| (**o).clone())
                    .collect();
                json_result(&list)?
            }
            crate::protocol::actions::PUT_MODULE => {
                who.check_any(Permission::Code, "ship code (put_module)")?;
                let body = body.clone();
                let sandbox = self.state.node.sandbox.clone();
                // Hashing and compiling are CPU work: on the pool, never on the RPC
                // threads.
                let (m, had) = self
                    .state
                    .node
                    .pool
                    .spawn(async move {
                        let had = sandbox.has(&crate::sandbox::ModuleDigest::of(&body));
                        sandbox.compile(&body).await.map(|m| (m, had))
                    })
                    .await?;
                json_result(&crate::protocol::actions::PutModuleResponse {
                    digest: m.digest.to_string(),
                    bytes: m.bytes as u64,
                    compiled: !had,
                })?
            }
            RENEW_FLIGHT_ENDPOINT => {
                let r = arrow_flight::RenewFlightEndpointRequest::decode(body.as_ref()).map_err(
                    |e| {
                        Error::InvalidArgument(format!("malformed RenewFlightEndpointRequest: {e}"))
                    },
                )?;
                let endpoint = r.endpoint.ok_or_else(|| {
                    Error::InvalidArgument("RenewFlightEndpoint names no endpoint".into())
                })?;
                let ticket = endpoint
                    .ticket
                    .as_ref()
                    .map(|t| t.ticket.clone())
                    .unwrap_or_default();
                let id = self.ref_of(&who, &ticket)?;
                let expires = match endpoint.expiration_time {
                    Some(t) => unix_ms_of(&t)?,
                    None => crate::refs::now_unix_ms()
                        .saturating_add(self.state.refs.max_ttl.as_millis() as u64),
                };
                let renewed = self
                    .state
                    .refs
                    .renew(&id, Self::ref_owner(&who), expires)
                    .await?;
                let mut out = endpoint.clone();
                out.expiration_time = Some(crate::refs::timestamp(renewed.expires_unix_ms));
                arrow_flight::Result {
                    body: out.encode_to_vec().into(),
                }
            }
            CANCEL_FLIGHT_INFO => {
                let r =
                    arrow_flight::CancelFlightInfoRequest::decode(body.as_ref()).map_err(|e| {
                        Error::InvalidArgument(format!("malformed CancelFlightInfoRequest: {e}"))
                    })?;
                let info = r.info.ok_or_else(|| {
                    Error::InvalidArgument("CancelFlightInfo names no FlightInfo".into())
                })?;
                let mut released = 0;
                for e in &info.endpoint {
                    let ticket = e
                        .ticket
                        .as_ref()
                        .map(|t| t.ticket.clone())
                        .unwrap_or_default();
                    if let Ok(id) = self.ref_of(&who, &ticket) {
                        self.state
                            .refs
                            .release(&self.state.node.tables, &id, Self::ref_owner(&who))
                            .await?;
                        released += 1;
                    }
                }
                let status = if released > 0 {
                    arrow_flight::CancelStatus::Cancelled
                } else {
                    arrow_flight::CancelStatus::NotCancellable
                };
                arrow_flight::Result {
                    body: arrow_flight::CancelFlightInfoResult::new(status)
                        .encode_to_vec()
                        .into(),
                }
            }
            crate::protocol::LeaseRequest::TYPE => {
                let r = crate::protocol::LeaseRequest::decode(body)?;
                who.check_any(Permission::Code, "lease slots for shipped code")?;
                if !r.seconds.is_finite() || r.seconds <= 0.0 {
                    return Err(Error::InvalidArgument(format!(
                        "a lease lasts a positive number of seconds, not {}",
                        r.seconds
                    ))
                    .into());
                }
                let idle = match r.idle_seconds {
                    Some(i) if !i.is_finite() || i <= 0.0 => {
                        return Err(Error::InvalidArgument(format!(
                            "idle_seconds must be a positive number of seconds, not {i}"
                        ))
                        .into());
                    }
                    i => i.map(|i| std::time::Duration::from_secs_f64(i.min(1e9))),
                };
                // The lease holds `slots` of its tenant's max_requests while it lasts.
                let mut quota = Vec::new();
                if who.tenant().is_some_and(|t| t.max_requests.is_some()) {
                    for _ in 0..r.slots {
                        quota.push(who.request_slot().map_err(|e| {
                            Error::ResourcesExhausted(format!(
                                "a lease of {} slots counts as {} requests: {e}",
                                r.slots, r.slots
                            ))
                        })?);
                    }
                }
                let info = self.state.leases.grant(
                    &self.state.admission,
                    crate::lease::Grant {
                        tenant: who.name().to_string(),
                        bucket: self.state.admission.bucket(who.name()),
                        slots: r.slots,
                        memory: r.memory.map(|m| m.0).unwrap_or(0),
                        ttl: std::time::Duration::from_secs_f64(r.seconds.min(1e9)),
                        max_ttl: self.state.lease_max,
                        idle,
                        quota,
                    },
                )?;
                tracing::info!(lease = %info.id, tenant = %info.tenant, slots = info.slots, "lease granted");
                json_result(&info)?
            }
            crate::protocol::ReleaseLeaseRequest::TYPE => {
                let r = crate::protocol::ReleaseLeaseRequest::decode(body)?;
                json_result(&self.state.leases.release(
                    &self.state.admission,
                    &r.lease,
                    Self::ref_owner(&who),
                )?)?
            }
            crate::protocol::TouchLeaseRequest::TYPE => {
                let r = crate::protocol::TouchLeaseRequest::decode(body)?;
                json_result(&self.state.leases.touch(&r.lease, Self::ref_owner(&who))?)?
            }
            crate::protocol::LeasesRequest::TYPE => {
                crate::protocol::LeasesRequest::decode(body)?;
                json_result(&self.state.leases.list(Self::ref_owner(&who)))?
            }
            crate::protocol::INVOKE => {
                who.check_any(Permission::Code, "invoke shipped code")?;
                self.invoke(&who, body.clone()).await?
            }
            ReleaseRequest::TYPE => {
                let r = ReleaseRequest::decode(body)?;
                let ticket = r.ticket_bytes()?;
                let id = self.ref_of(&who, &ticket)?;
                json_result(
                    &self
                        .state
                        .refs
                        .release(&self.state.node.tables, &id, Self::ref_owner(&who))
                        .await?,
                )?
            }
            RefsRequest::TYPE => {
                RefsRequest::decode(body)?;
                let list: Vec<crate::protocol::actions::RefDescription> = self
                    .state
                    .refs
                    .list(Self::ref_owner(&who))
                    .iter()
                    .map(|r| {
                        let holder = match Self::ref_owner(&who) {
                            Some(t) => t,
                            None => &r.tenant,
                        };
                        self.ref_description(holder, r)
                    })
                    .collect();
                json_result(&list)?
            }
            crate::protocol::actions::GrantRequest::TYPE => {
                let r = crate::protocol::actions::GrantRequest::decode(body)?;
                let id = self.ref_of(&who, &r.ticket_bytes()?)?;
                if self.state.auth.enabled() && !self.state.auth.knows(&r.tenant) {
                    return Err(Error::InvalidArgument(format!(
                        "no tenant named {:?} at this node: a kept result is granted to a tenant of its tenants file",
                        truncated(&r.tenant)
                    ))
                    .into());
                }
                let info = self
                    .state
                    .refs
                    .grant(&id, Self::ref_owner(&who), &r.tenant, r.revoke)
                    .await?;
                tracing::info!(reference = %info.id, to = %r.tenant, revoke = r.revoke, "grant");
                json_result(&self.ref_description(&r.tenant, &info))?
            }
            other => {
                let known: Vec<&str> = ACTIONS.iter().map(|(t, _)| *t).collect();
                return Err(Error::InvalidArgument(format!(
                    "unknown action {:?}: this node knows {}",
                    crate::error::truncated(other),
                    known.join(", ")
                ))
                .into());
            }
        };
        Ok(one(result))
    }

    async fn list_actions(
        &self,
        request: Request<Empty>,
    ) -> Result<Response<Self::ListActionsStream>, Status> {
        self.who(&request)?;
        let actions = ACTIONS.map(|(t, d)| {
            Ok(ActionType {
                r#type: t.into(),
                description: d.into(),
            })
        });
        Ok(Response::new(futures::stream::iter(actions).boxed()))
    }
}

/// `RenewFlightEndpoint`: Flight's action extending a kept result's expiry (body and
/// answer: protobuf `RenewFlightEndpointRequest` / `FlightEndpoint`).
pub(crate) const RENEW_FLIGHT_ENDPOINT: &str = "RenewFlightEndpoint";
/// `CancelFlightInfo`: Flight's action freeing the kept results a `FlightInfo`
/// names (protobuf `CancelFlightInfoRequest` / `CancelFlightInfoResult`).
pub(crate) const CANCEL_FLIGHT_INFO: &str = "CancelFlightInfo";

fn unix_ms_of(t: &prost_types::Timestamp) -> Result<u64> {
    if t.seconds < 0 || !(0..1_000_000_000).contains(&t.nanos) {
        return Err(Error::InvalidArgument(format!(
            "expiration time {}s {}ns is not a time after 1970",
            t.seconds, t.nanos
        )));
    }
    Ok((t.seconds as u64).saturating_mul(1000) + (t.nanos as u64) / 1_000_000)
}

/// An error out of a Flight stream of our own making, as the node's error (a status
/// keeps its code and message).
fn flight_error(e: FlightError) -> Error {
    match e {
        FlightError::Tonic(s) => crate::refs::status_error(*s),
        e => Error::from(e),
    }
}
