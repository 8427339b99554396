//! [`EndpointStream`]: one partition of a scan, as a state machine. It opens the
//! endpoint ([`EndpointOpener`]), then passes on the node's batches (or those
//! evaluated here) under the plan's schema, and when the node's answer ends records
//! what the endpoint did.
//!
//! A partition kept on several nodes (see `crate::compute::replicas`) fails over:
//! when its node is lost before its answer was passed on, the same fragment is
//! asked of the next copy. To make that possible mid-answer too, the node's batches
//! are held until its answer ends (up to [`HOLD_BYTES`]; past that they stream, and
//! a node lost after that fails the query, naming the partition and every copy
//! tried). Reads by byte range fail over below, in the range store.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};

use arrow::array::RecordBatchOptions;
use arrow::datatypes::{DataType, SchemaRef};
use arrow::record_batch::RecordBatch;
use csd_protocol::node_client::ReplyStats;
use datafusion::common::{DataFusionError, Result};
use datafusion::physical_plan::{RecordBatchStream, SendableRecordBatchStream};
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, Stream, StreamExt};

use super::EndpointRun;
use super::metrics::ScanMetrics;
use super::opener::{EndpointOpener, Opened};
use crate::compute::endpoints::Endpoint;
use crate::compute::range_read::counting_reads;
use crate::error::{node_lost, to_datafusion};

/// Where a partition leaves its [`EndpointRun`] for `EXPLAIN ANALYZE` and `csd sql`.
pub(crate) type RunSlot = Arc<Mutex<Option<EndpointRun>>>;

/// The most of a node's answer held back while another copy could still take over.
pub(crate) const HOLD_BYTES: usize = 16 << 20;

/// What a stream needs to ask another copy of its partition.
struct Failover {
    /// The opener, for the copy asked last.
    opener: EndpointOpener,
    /// Copies not asked yet.
    replicas: VecDeque<Endpoint>,
    /// Copies asked, each with why it did not answer.
    tried: Vec<String>,
    /// The node's batches held back (see the module docs), while `holding`.
    held: Vec<RecordBatch>,
    held_bytes: usize,
    holding: bool,
}

impl Failover {
    /// The opener of the next copy after `endpoint` (the copy asked) failed with
    /// `why`: another node holding it, and when none is left, this tier over the
    /// objects' other copies by byte range (an endpoint standing for several
    /// partitions has no replica of its own, its objects do). `None` when a batch
    /// was passed on already, or this tier was tried.
    fn next(
        &mut self,
        endpoint: &str,
        why: &dyn std::fmt::Display,
        passed: bool,
    ) -> Option<EndpointOpener> {
        if passed || self.opener.here.is_some() {
            return None;
        }
        self.tried.push(format!("{endpoint}: {why}"));
        self.held.clear();
        self.held_bytes = 0;
        match self.replicas.pop_front() {
            Some(next) => {
                tracing::warn!(%endpoint, to = %next.client.url(), "asking another copy: {why}");
                self.opener = self.opener.at_copy(&next);
            }
            None => {
                tracing::warn!(%endpoint, "evaluating here over the objects' copies: {why}");
                self.opener.here = Some(format!("node lost ({why}): read here from the copies"));
            }
        }
        Some(self.opener.clone())
    }

    /// Another copy runs the fragment, which the copy asked first handed back for
    /// its load (`declined`: each copy that did not, with why): should that copy's
    /// node be lost, the others are asked, the busy one last.
    fn moved_to(&mut self, copy: &Endpoint, declined: Vec<String>) {
        let there = self.opener.at_copy(copy);
        let first = std::mem::replace(&mut self.opener, there);
        let url = copy.client.url();
        self.replicas.retain(|r| r.client.url() != url);
        self.replicas.push_back(first.endpoint);
        self.tried.extend(declined);
    }
}

enum State {
    /// Waiting for join keys and the node's first answer.
    Opening(BoxFuture<'static, Result<Opened>>),
    /// The node's batches.
    FromNode {
        batches: BoxStream<'static, csd_protocol::node_client::Result<RecordBatch>>,
        stats: Arc<ReplyStats>,
    },
    /// Batches evaluated here.
    Here(SendableRecordBatchStream),
    /// Ended (or failed).
    Done,
}

/// One endpoint's share of a scan (see the module docs).
pub(crate) struct EndpointStream {
    state: State,
    schema: SchemaRef,
    metrics: ScanMetrics,
    run: RunSlot,
    endpoint: String,
    direct: bool,
    /// Bytes read by byte range while this stream is polled (see `poll_next`).
    ranges: Arc<AtomicU64>,
    failover: Failover,
    /// Batches to pass on before anything else (held ones, released).
    pending: VecDeque<RecordBatch>,
    /// Whether a batch was passed on (no other copy may take over then).
    passed: bool,
}

impl EndpointStream {
    /// A stream that opens with `opener` and answers `schema`.
    pub(super) fn new(
        opener: EndpointOpener,
        schema: SchemaRef,
        metrics: ScanMetrics,
        run: RunSlot,
    ) -> Self {
        let endpoint = opener.label();
        let direct = opener.direct;
        if let Ok(mut g) = run.lock() {
            *g = None;
        }
        let replicas: VecDeque<Endpoint> = opener.endpoint.replicas.iter().cloned().collect();
        // Held while another copy could take over: a node's answer, when its objects
        // have copies elsewhere.
        let copies = !replicas.is_empty() || opener.table.has_copies(&opener.endpoint);
        let failover = Failover {
            opener: opener.clone(),
            holding: copies,
            replicas,
            tried: vec![],
            held: vec![],
            held_bytes: 0,
        };
        EndpointStream {
            state: State::Opening(opener.open().boxed()),
            schema,
            metrics,
            run,
            endpoint,
            direct,
            ranges: Arc::new(AtomicU64::new(0)),
            failover,
            pending: VecDeque::new(),
            passed: false,
        }
    }

    /// Asks the next copy of the partition after this one failed with `why`;
    /// false when none can take over.
    fn fail_over(&mut self, why: &dyn std::fmt::Display) -> bool {
        match self.failover.next(&self.endpoint, why, self.passed) {
            Some(opener) => {
                self.endpoint = opener.label();
                self.state = State::Opening(opener.open().boxed());
                true
            }
            None => false,
        }
    }

    /// `e`, naming the copies tried before, if any.
    fn failed(&self, e: DataFusionError) -> DataFusionError {
        match self.failover.tried.is_empty() {
            true => e,
            false => DataFusionError::Context(
                format!(
                    "no copy of partition {} of table {} answered (tried {}; last {})",
                    self.failover.opener.endpoint.partition,
                    self.failover.opener.table.name(),
                    self.failover.tried.join("; "),
                    self.endpoint
                ),
                Box::new(e),
            ),
        }
    }

    fn record(&self, run: EndpointRun) {
        if let Ok(mut g) = self.run.lock() {
            *g = Some(run);
        }
    }

    /// The node's answer has ended: count and record what it reported.
    fn finish_node(&self, stats: &ReplyStats) {
        let bytes = stats.bytes_received.load(Ordering::Relaxed);
        self.metrics.bytes_received.add(bytes as usize);
        let report = stats.report().unwrap_or_default();
        self.metrics.node_bytes_read.add(report.bytes_read as usize);
        self.metrics
            .node_rows_scanned
            .add(report.rows_scanned as usize);
        self.record(EndpointRun {
            endpoint: self.endpoint.clone(),
            bytes_received: bytes,
            report,
            failed_over: self.failover.tried.clone(),
            ..Default::default()
        });
    }

    fn batch(&mut self, b: RecordBatch) -> Result<RecordBatch> {
        self.passed = true;
        self.metrics.output_rows.add(b.num_rows());
        relabel(b, &self.schema)
    }
}

impl Stream for EndpointStream {
    type Item = Result<RecordBatch>;

    /// Polls with the process's byte-range reads counted for this scan: on a
    /// worker they are the only record of what a direct or handed-back scan read.
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let ranges = self.ranges.clone();
        let polled = counting_reads(&ranges, || self.as_mut().poll_inner(cx));
        let read = ranges.swap(0, Ordering::Relaxed);
        if read > 0 {
            self.metrics.range_bytes.add(read as usize);
        }
        polled
    }
}

impl EndpointStream {
    fn poll_inner(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<RecordBatch>>> {
        loop {
            let this = &mut *self;
            if let Some(b) = this.pending.pop_front() {
                return Poll::Ready(Some(this.batch(b)));
            }
            match &mut this.state {
                State::Opening(open) => match ready!(open.poll_unpin(cx)) {
                    Ok(Opened::Node {
                        batches,
                        stats,
                        moved_to,
                        declined,
                    }) => {
                        if let Some(copy) = moved_to {
                            this.failover.moved_to(&copy, declined);
                            this.endpoint = this.failover.opener.label();
                        }
                        this.state = State::FromNode { batches, stats };
                    }
                    Ok(Opened::Here {
                        stream,
                        pushed_back,
                        declined,
                    }) => {
                        if pushed_back.is_some() {
                            this.metrics.pushed_back.add(1);
                        }
                        this.failover.tried.extend(declined);
                        this.record(EndpointRun {
                            endpoint: this.endpoint.clone(),
                            pushed_back,
                            direct: this.direct,
                            failed_over: this.failover.tried.clone(),
                            ..Default::default()
                        });
                        this.state = State::Here(stream);
                    }
                    Err(e) => {
                        if node_lost(&e) && this.fail_over(&e) {
                            continue;
                        }
                        this.state = State::Done;
                        return Poll::Ready(Some(Err(this.failed(e))));
                    }
                },
                State::FromNode { batches, stats } => match ready!(batches.poll_next_unpin(cx)) {
                    Some(Ok(b)) if this.failover.holding => {
                        let f = &mut this.failover;
                        f.held_bytes += b.get_array_memory_size();
                        f.held.push(b);
                        if f.held_bytes > HOLD_BYTES {
                            f.holding = false;
                            this.pending.extend(f.held.drain(..));
                        }
                    }
                    Some(Ok(b)) => return Poll::Ready(Some(this.batch(b))),
                    Some(Err(e)) => {
                        if e.node_lost() && this.fail_over(&e) {
                            continue;
                        }
                        this.state = State::Done;
                        return Poll::Ready(Some(Err(this.failed(to_datafusion(e)))));
                    }
                    None => {
                        let stats = stats.clone();
                        this.finish_node(&stats);
                        this.pending.extend(this.failover.held.drain(..));
                        this.state = State::Done;
                    }
                },
                State::Here(stream) => match ready!(stream.poll_next_unpin(cx)) {
                    Some(Ok(b)) => return Poll::Ready(Some(this.batch(b))),
                    Some(Err(e)) => {
                        this.state = State::Done;
                        return Poll::Ready(Some(Err(e)));
                    }
                    None => {
                        this.state = State::Done;
                        return Poll::Ready(None);
                    }
                },
                State::Done => return Poll::Ready(None),
            }
        }
    }
}

impl RecordBatchStream for EndpointStream {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }
}

/// The node's batch under our schema: same columns by position. Names may differ
/// after the Substrait round trip; decimal precision may too (a literal's width),
/// which a cast fixes exactly; any other difference is an error, never a silent
/// conversion.
fn relabel(b: RecordBatch, schema: &SchemaRef) -> Result<RecordBatch> {
    if b.num_columns() != schema.fields().len() {
        return Err(DataFusionError::Execution(format!(
            "storage node returned {} columns, expected {} ({schema})",
            b.num_columns(),
            schema.fields().len()
        )));
    }
    let mut cols = Vec::with_capacity(b.num_columns());
    for (c, f) in b.columns().iter().zip(schema.fields()) {
        if c.data_type() == f.data_type() {
            cols.push(c.clone());
            continue;
        }
        let same_scale = matches!(
            (c.data_type(), f.data_type()),
            (DataType::Decimal128(_, s1), DataType::Decimal128(_, s2)) if s1 == s2
        );
        if !same_scale {
            return Err(DataFusionError::Execution(format!(
                "storage node returned {} for column {}, expected {}",
                c.data_type(),
                f.name(),
                f.data_type()
            )));
        }
        let strict = arrow::compute::CastOptions {
            safe: false,
            ..Default::default()
        };
        cols.push(arrow::compute::cast_with_options(
            c,
            f.data_type(),
            &strict,
        )?);
    }
    Ok(RecordBatch::try_new_with_options(
        schema.clone(),
        cols,
        &RecordBatchOptions::new().with_row_count(Some(b.num_rows())),
    )?)
}
