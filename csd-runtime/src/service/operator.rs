//! A pushed-down operator request, from ticket to answer, in one place: its
//! arguments parsed once by its operator ([`OperatorRequest`]), the tenant's
//! permissions checked for what that request reads and runs, the asker's figures
//! completed with what this node learned of its link, a slot taken (a lease's, or
//! admission's permit), the operator opened on the CPU pool, and its batches
//! streamed with the trailing [`OperatorReport`].

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use arrow::ipc::writer::IpcWriteOptions;
use arrow_flight::FlightData;
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use tokio::sync::mpsc;

use super::FlightNode;
use super::answer_codec;
use super::stream::{ENCODER_LIMIT, TaskStream, forward};
use crate::admission::{Ask, Asker, CostKey, Kept, Permit, Refusal};
use crate::auth::{Permission, Principal, RequestSlot};
use crate::error::{Error, Result, truncated};
use crate::lease::LeaseRun;
use crate::link::LinkMeter;
use crate::operator::{
    CancelOnDrop, Estimate, OperatorContext, OperatorRequest, RequestMetrics, wire_pieces,
};
use crate::protocol::{AdmissionReport, AskerFigures, Compression, LeaseIds, OperatorReport};

/// One operator request as the service received it (a `DoGet` ticket, or the
/// command of a `GetFlightInfo` that keeps its answer).
pub(super) struct OperatorCall {
    /// Who asks.
    pub(super) who: Principal,
    /// From where (its link is priced when handing back).
    pub(super) peer: Option<IpAddr>,
    /// The operator's name.
    pub(super) name: String,
    /// Its arguments, in the operator's own format.
    pub(super) args: Vec<u8>,
    /// How the answer's IPC bodies are compressed.
    pub(super) compression: Compression,
    /// Queue rather than hand back for queueing delay.
    pub(super) patient: bool,
    /// What handing it back would cost the asker, as it measured.
    pub(super) asker: Option<AskerFigures>,
    /// The leases it may run on (`csd-lease`).
    pub(super) lease: Option<LeaseIds>,
}

/// What a request runs under: admission's permit, or a lease's slot.
enum Slot {
    /// Admission's permit and one of the tenant's request slots (`max_requests`;
    /// a lease holds its own).
    Admitted {
        permit: Permit,
        _request: RequestSlot,
    },
    /// A lease's slot (held until the answer ends).
    Leased { _run: LeaseRun },
}

/// How the slot was had, for the report.
struct Admitted {
    slot: Slot,
    report: AdmissionReport,
}

impl FlightNode {
    /// Runs `call`: parsed, checked, priced, admitted (or handed back), opened on
    /// the CPU pool; a bad request fails the call itself, before any answer.
    pub(super) async fn run_operator(&self, mut call: OperatorCall) -> Result<TaskStream> {
        let started = Instant::now();
        let op = self
            .state
            .operators
            .get(&call.name)
            .cloned()
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "operator {:?} is not served by this node (it serves: {})",
                    truncated(&call.name),
                    self.state.operators.names().join(", ")
                ))
            })?;
        let request = op.parse(Bytes::from(std::mem::take(&mut call.args)))?;
        self.authorize(&call.who, request.as_ref())?;
        let (asker, meter) = self.asker(call.peer, call.asker.as_ref());
        let metrics = Arc::new(RequestMetrics::default());
        let cancelled = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // Dropped with this handler, or with the answer's stream once it is returned.
        let waiting = CancelOnDrop(cancelled.clone());
        let ctx = OperatorContext {
            node: self.state.node.clone(),
            metrics: metrics.clone(),
            principal: call.who.clone(),
            cancelled,
        };
        // Estimated (and a request it cannot serve refused) before it can queue.
        let estimate = request.estimate(&ctx).await?;
        let admitted = self.admit(&call, request.as_ref(), estimate, asker).await;
        let admitted = match (admitted, meter) {
            (Err(Error::PushedBack(p)), Some((m, link))) => {
                m.handed_back(p.bytes, link);
                return Err(Error::PushedBack(p));
            }
            (a, _) => a?,
        };
        let report = Reporter {
            operator: call.name,
            metrics,
            started,
            admission: admitted.report,
        };
        self.open(
            request,
            ctx,
            admitted.slot,
            report,
            call.compression,
            waiting,
        )
        .await
    }

    /// `Ok` if `who` may run `request`: its `code` permission when the request runs
    /// code it ships, and `read` on every table it reads (kept results' tables are
    /// checked on an open node too: only their owner reads them).
    fn authorize(&self, who: &Principal, request: &dyn OperatorRequest) -> Result<()> {
        if who.tenant().is_some() && request.ships_code() {
            who.check_any(Permission::Code, "run code it ships (WebAssembly)")?;
        }
        for t in request.tables() {
            if who.tenant().is_some() || crate::refs::is_ref_table(&t) {
                self.check_table(who, Permission::Read, &t)?;
            }
        }
        Ok(())
    }

    /// The asker's side of the decision to hand back: its own figures first, else
    /// what this node learned of its link; and that link's meter, to record what is
    /// handed back to it.
    fn asker(
        &self,
        peer: Option<IpAddr>,
        figures: Option<&AskerFigures>,
    ) -> (Asker, Option<(Arc<LinkMeter>, f64)>) {
        let known = |v: f64| (v > 0.0).then_some(v);
        let link = figures
            .and_then(|a| known(a.link_bytes_per_s))
            .or_else(|| peer.and_then(|p| self.state.links.bytes_per_sec(p)));
        // What this node handed back to that link lately and it has not carried yet.
        let meter = peer.zip(link).map(|(p, l)| (self.state.links.of(p), l));
        let asker = Asker {
            link_bytes_per_s: link,
            load: figures.map(|a| a.load).unwrap_or(0.0),
            backlog_bytes: meter.as_ref().map_or(0, |(m, l)| m.backlog(*l)),
            // On this host, on cores the node's workers keep busy (as many workers
            // as the node may use cores): work handed back would run behind them.
            shares_cores: self.state.node.pool.threads() >= self.state.host.cpus.len()
                && figures.is_some_and(|a| self.state.host.within(&a.host, &a.cpus)),
        };
        (asker, meter)
    }

    /// A slot for the request: on a lease of its tenant that the request names
    /// (without queueing), else from admission (run, queue, or hand back).
    async fn admit(
        &self,
        call: &OperatorCall,
        request: &dyn OperatorRequest,
        estimate: Estimate,
        asker: Asker,
    ) -> Result<Admitted> {
        let (who, patient) = (&call.who, call.patient);
        let mut report = AdmissionReport {
            estimate_bytes: estimate.bytes,
            patient,
            ..AdmissionReport::default()
        };
        if let Some(ids) = &call.lease {
            let owner = Self::ref_owner(who);
            let leased = self
                .state
                .leases
                .run_on(&self.state.admission, ids, owner, estimate.memory)
                .await?;
            if let Some(run) = leased {
                report.queue_ms = ms(run.waited);
                report.lease = Some(run.id().to_string());
                return Ok(Admitted {
                    slot: Slot::Leased { _run: run },
                    report,
                });
            }
        }
        let request_slot = who.request_slot()?;
        let ask = Ask {
            operator: request
                .cost_key()
                .unwrap_or_else(|| CostKey::Operator(call.name.clone())),
            tenant: self.state.admission.bucket(who.name()),
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
        report.queue_ms = ms(permit.waited);
        report.predicted_queue_ms = ms(permit.predicted);
        report.estimate_ms = ms(permit.estimate);
        report.kept_for_link = permit.kept == Some(Kept::ForLink);
        report.kept_shared_cores = permit.kept == Some(Kept::SharedCores);
        // A patient request waits because its asker is saturated, past the bound
        // or not.
        let kept = permit.kept.or(patient.then_some(Kept::Patient));
        report.queue_reason = self
            .state
            .admission
            .why_waited(permit.waited, permit.estimate, kept);
        Ok(Admitted {
            slot: Slot::Admitted {
                permit,
                _request: request_slot,
            },
            report,
        })
    }

    /// Opens `request` on the CPU pool and streams its answer from there: one task
    /// opens it and drives its batches, and this handler waits only for the open's
    /// outcome (a bad request fails the call itself), not for a second hop.
    async fn open(
        &self,
        request: Box<dyn OperatorRequest>,
        ctx: OperatorContext,
        mut slot: Slot,
        report: Reporter,
        compression: Compression,
        waiting: CancelOnDrop,
    ) -> Result<TaskStream> {
        let piece = self.state.wire_piece;
        let options = IpcWriteOptions::default().try_with_compression(match compression {
            Compression::None => None,
            // An answer that cannot adapt (it has dictionaries) goes LZ4 throughout.
            Compression::Lz4Frame | Compression::Auto => {
                Some(arrow::ipc::CompressionType::LZ4_FRAME)
            }
            Compression::Zstd => Some(arrow::ipc::CompressionType::ZSTD),
        })?;
        let (opened_tx, opened_rx) = tokio::sync::oneshot::channel::<Result<()>>();
        let (tx, rx) = mpsc::channel(ANSWER_QUEUE);
        // The answer's own queue tells the adaptive encoder how far sending lags.
        let queue = tx.clone();
        let task = self.state.node.pool.spawn(async move {
            let opened = match request.open(ctx).await {
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
                            let pieces = wire_pieces(b, piece);
                            Ok(futures::stream::iter(pieces.into_iter().map(Ok)))
                        }
                        Err(e) => Err(FlightError::ExternalError(Box::new(e))),
                    }
                })
                .try_flatten();
            let encoder =
                if compression == Compression::Auto && answer_codec::adaptable(&opened.schema) {
                    let waiting = move || queue.max_capacity() - queue.capacity();
                    answer_codec::encode(opened.schema, batches, waiting, ANSWER_QUEUE)?.boxed()
                } else {
                    drop(queue);
                    FlightDataEncoderBuilder::new()
                        .with_max_flight_data_size(ENCODER_LIMIT)
                        .with_options(options)
                        .with_schema(opened.schema)
                        .build(batches)
                        .boxed()
                };
            // Ran to the end: its time teaches the cost model; the slot is freed
            // before the report goes.
            forward(encoder, &tx, |sent| {
                if let Slot::Admitted { permit, .. } = &mut slot {
                    permit.complete();
                }
                drop(slot);
                report.trailer(sent, rows.load(Ordering::Relaxed))
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
}

/// Encoded messages of an answer queued ahead of the network.
const ANSWER_QUEUE: usize = 4;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// What the trailing report is made of, once the answer has been sent.
struct Reporter {
    operator: String,
    metrics: Arc<RequestMetrics>,
    started: Instant,
    admission: AdmissionReport,
}

impl Reporter {
    /// The report's message: the request's figures after `bytes_sent` bytes and
    /// `rows` rows.
    fn trailer(self, bytes_sent: u64, rows: u64) -> Option<FlightData> {
        let report = OperatorReport {
            operator: self.operator,
            bytes_read: self.metrics.bytes_read.load(Ordering::Relaxed),
            bytes_sent,
            rows_scanned: self.metrics.rows_scanned.load(Ordering::Relaxed),
            rows_returned: rows,
            elapsed_us: self.started.elapsed().as_micros() as u64,
            admission: self.admission,
            details: self.metrics.details(),
        };
        let json = serde_json::to_vec(&report).ok()?;
        Some(FlightData::new().with_app_metadata(json))
    }
}
