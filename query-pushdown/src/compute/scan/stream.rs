//! [`EndpointStream`]: one partition of a scan, as a state machine. It opens the
//! endpoint ([`EndpointOpener`]), then passes on the node's batches (or those
//! evaluated here) under the plan's schema, and when the node's answer ends records
//! what the endpoint did.
//!
//! A partition kept on several nodes (see `crate::compute::replicas`) is asked of
//! its copies in turn, as [`Copies`] decides: the next copy when a node hands the
//! fragment back for its load or is lost before its answer was passed on, this tier
//! when none is left or a node judged the fragment not worth running. To make that
//! possible mid-answer too, the node's batches are held until its answer ends (up
//! to [`HOLD_BYTES`]; past that they stream, and a node lost after that fails the
//! query, naming the partition and every copy tried). Reads by byte range fail over
//! below, in the range store.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};

use arrow::array::RecordBatchOptions;
use arrow::datatypes::{DataType, SchemaRef};
use arrow::record_batch::RecordBatch;
use csd_protocol::node_client::{Copies, Declined, Next, ReplyStats, Tried};
use datafusion::common::{DataFusionError, Result};
use datafusion::physical_plan::{RecordBatchStream, SendableRecordBatchStream};
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, Stream, StreamExt};

use super::metrics::ScanMetrics;
use super::opener::{EndpointOpener, Opened};
use super::run::EndpointRun;
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
    /// The partition's other copies, and what asking came to.
    copies: Copies<Endpoint>,
    /// The node's batches held back (see the module docs), while `holding`.
    held: Vec<RecordBatch>,
    held_bytes: usize,
    holding: bool,
}

impl Failover {
    /// The opener to use after the copy asked last declined the fragment for `why`
    /// (see [`Copies::declined`]): another copy's, or this tier's (over the
    /// objects' copies by byte range when every node was lost: an endpoint standing
    /// for several partitions has no replica of its own, its objects do). `None`
    /// when a batch was passed on already, or this tier was tried.
    fn next(&mut self, why: Declined, passed: bool) -> Option<EndpointOpener> {
        if passed || self.opener.here.is_some() {
            return None;
        }
        self.held.clear();
        self.held_bytes = 0;
        let at = self.opener.label();
        match self.copies.declined(self.opener.endpoint.clone(), at, why) {
            Next::Ask(next) => self.opener = self.opener.at_copy(&next),
            Next::Here(_) | Next::NoneLeft => {
                self.opener.here = self.copies.ended_here().1;
            }
        }
        Some(self.opener.clone())
    }

    /// The copies asked that did not run the fragment (see `Copies::ended_here`).
    fn tried(&self) -> Vec<Tried> {
        match self.opener.here.is_some() {
            true => self.copies.ended_here().0,
            false => self.copies.tried().to_vec(),
        }
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
        let replicas = opener.endpoint.replicas.clone();
        // Held while another copy could take over: a node's answer, when its objects
        // have copies elsewhere.
        let holding = !replicas.is_empty() || opener.table.has_copies(&opener.endpoint);
        let failover = Failover {
            opener: opener.clone(),
            copies: Copies::new(replicas),
            holding,
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

    /// Asks the next copy of the partition (or this tier) after this one declined
    /// the fragment for `why`; false when none can take over.
    fn fail_over(&mut self, why: Declined) -> bool {
        match self.failover.next(why, self.passed) {
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
        let tried = self.failover.copies.tried();
        match tried.is_empty() {
            true => e,
            false => DataFusionError::Context(
                format!(
                    "no copy of partition {} of table {} answered (tried {}; last {})",
                    self.failover.opener.endpoint.partition,
                    self.failover.opener.table.name(),
                    Tried::list(tried),
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
            failed_over: self.failover.tried(),
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
                    Ok(Opened::Node { batches, stats }) => {
                        this.state = State::FromNode { batches, stats };
                    }
                    Ok(Opened::Declined(why)) => {
                        // Not reached: a node was asked, so this tier was not tried.
                        if !this.fail_over(why.clone()) {
                            this.state = State::Done;
                            let e = format!(
                                "{}: {why}, and no copy or this tier is left",
                                this.endpoint
                            );
                            return Poll::Ready(Some(Err(DataFusionError::Internal(e))));
                        }
                    }
                    Ok(Opened::Here(stream)) => {
                        let pushed_back = this.failover.opener.here.clone();
                        if pushed_back.is_some() {
                            this.metrics.pushed_back.add(1);
                        }
                        this.record(EndpointRun {
                            endpoint: this.endpoint.clone(),
                            pushed_back,
                            direct: this.direct,
                            failed_over: this.failover.tried(),
                            ..Default::default()
                        });
                        this.state = State::Here(stream);
                    }
                    Err(e) => {
                        if node_lost(&e) && this.fail_over(Declined::Lost(e.to_string())) {
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
                        if e.node_lost() && this.fail_over(Declined::Lost(e.to_string())) {
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
