//! [`EndpointStream`]: one partition of a scan, as a state machine. It opens the
//! endpoint ([`EndpointOpener`]), then passes on the node's batches (or those
//! evaluated here) under the plan's schema, and when the node's answer ends records
//! what the endpoint did.

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
use crate::compute::range_read::counting_reads;
use crate::error::to_datafusion;

/// Where a partition leaves its [`EndpointRun`] for `EXPLAIN ANALYZE` and `csd sql`.
pub(crate) type RunSlot = Arc<Mutex<Option<EndpointRun>>>;

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
}

impl EndpointStream {
    /// A stream that opens with `opener` and answers `schema`.
    pub(super) fn new(
        opener: EndpointOpener,
        schema: SchemaRef,
        metrics: ScanMetrics,
        run: RunSlot,
    ) -> Self {
        let endpoint = format!(
            "{}/{}",
            opener.endpoint.client.url(),
            opener.endpoint.partition
        );
        let direct = opener.direct;
        if let Ok(mut g) = run.lock() {
            *g = None;
        }
        EndpointStream {
            state: State::Opening(opener.open().boxed()),
            schema,
            metrics,
            run,
            endpoint,
            direct,
            ranges: Arc::new(AtomicU64::new(0)),
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
            ..Default::default()
        });
    }

    fn batch(&self, b: RecordBatch) -> Result<RecordBatch> {
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
            match &mut this.state {
                State::Opening(open) => match ready!(open.poll_unpin(cx)) {
                    Ok(Opened::Node { batches, stats }) => {
                        this.state = State::FromNode { batches, stats };
                    }
                    Ok(Opened::Here {
                        stream,
                        pushed_back,
                    }) => {
                        if pushed_back.is_some() {
                            this.metrics.pushed_back.add(1);
                        }
                        this.record(EndpointRun {
                            endpoint: this.endpoint.clone(),
                            pushed_back,
                            direct: this.direct,
                            ..Default::default()
                        });
                        this.state = State::Here(stream);
                    }
                    Err(e) => {
                        this.state = State::Done;
                        return Poll::Ready(Some(Err(e)));
                    }
                },
                State::FromNode { batches, stats } => match ready!(batches.poll_next_unpin(cx)) {
                    Some(Ok(b)) => return Poll::Ready(Some(this.batch(b))),
                    Some(Err(e)) => {
                        this.state = State::Done;
                        return Poll::Ready(Some(Err(to_datafusion(e))));
                    }
                    None => {
                        let stats = stats.clone();
                        this.finish_node(&stats);
                        this.state = State::Done;
                        return Poll::Ready(None);
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
