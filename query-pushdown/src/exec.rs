//! `CsdScanExec`: the compute-side leaf that runs a pushed fragment on every endpoint
//! (one output partition per node partition, read in parallel) and collects what each
//! node reports, for `EXPLAIN ANALYZE` and the byte counts of `csd sql`.

use std::fmt;
use std::sync::{Arc, Mutex};

use arrow::array::RecordBatchOptions;
use arrow::datatypes::{DataType, SchemaRef};
use arrow::record_batch::RecordBatch;
use csd_runtime::operator::OperatorReport;
use datafusion::common::stats::Precision;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{DataFusionError, Result, Statistics};
use datafusion::execution::TaskContext;
use datafusion::physical_expr::EquivalenceProperties;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricBuilder, MetricsSet};
use datafusion::physical_plan::stream::{RecordBatchReceiverStream, RecordBatchStreamAdapter};
use datafusion::physical_plan::{
    ChildrenPropertiesMode, DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning,
    PhysicalExpr, PlanProperties, ReplaceChildrenOptions, SendableRecordBatchStream,
};
use futures::{StreamExt, TryStreamExt};

use crate::error::to_datafusion;
use crate::fragment::{Mode, OPERATOR_NAME, SqlFragment};
use crate::keyfilter::filter_stream;
use crate::semijoin::KeyCollector;
use crate::storage::{Parallelism, fragment_session, key_filtered, plan_fragment};
use crate::table::{CsdTable, Endpoint};
use csd_runtime::client::Error as ClientError;

/// What one endpoint did for one execution.
#[derive(Debug, Clone, Default)]
pub struct EndpointRun {
    /// `node-url/partition`.
    pub endpoint: String,
    /// Bytes received from the node (Arrow IPC, after compression).
    pub bytes_received: u64,
    /// The node's report.
    pub report: OperatorReport,
    /// Set when the node handed the fragment back (why): the compute tier read the
    /// byte ranges and evaluated it here.
    pub pushed_back: Option<String>,
    /// A scan that reduces nothing, read here by byte range (see
    /// [`CsdScanExec::direct`]).
    pub direct: bool,
}

impl EndpointRun {
    /// Whether the node handed back work it was asked to do, which the compute tier
    /// then did. A direct scan handed back is not: it is read by byte range, as it
    /// would have been without its join-key filter (the node declines one whose filter
    /// keeps most rows, whatever its load).
    pub fn work_pushed_back(&self) -> bool {
        self.pushed_back.is_some() && !self.direct
    }
}

/// A direct scan with a join-key filter is worth running at the node only when the
/// filter keeps at most this fraction of the rows (Arrow IPC of the survivors
/// against compressed Parquet of them all); the node checks its first rows.
pub const DIRECT_ABOVE: f32 = 0.3;

/// Batches a scan receives ahead of its consumer (see `execute`).
const PREFETCH_BATCHES: usize = 2;

/// Runs a pushed fragment on all endpoints of a table.
#[derive(Debug)]
pub struct CsdScanExec {
    table: CsdTable,
    schema: SchemaRef,
    plan: Arc<Vec<u8>>,
    mode: Mode,
    describe: String,
    props: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
    runs: Arc<Vec<Mutex<Option<EndpointRun>>>>,
    row_fraction: Option<f64>,
    limit: Option<usize>,
    key_filters: Vec<(Arc<KeyCollector>, Vec<usize>)>,
    direct: bool,
    pinned: bool,
}

impl CsdScanExec {
    /// A scan of `table` answering `schema`, running Substrait `plan` in `mode`;
    /// `describe` is what EXPLAIN shows as pushed.
    pub fn new(
        table: CsdTable,
        schema: SchemaRef,
        plan: Vec<u8>,
        mode: Mode,
        describe: String,
    ) -> Self {
        let n = table.endpoints().len();
        let props = PlanProperties::new(
            EquivalenceProperties::new(schema.clone()),
            Partitioning::UnknownPartitioning(n.max(1)),
            EmissionType::Incremental,
            Boundedness::Bounded,
        );
        CsdScanExec {
            table,
            schema,
            plan: Arc::new(plan),
            mode,
            describe,
            props: Arc::new(props),
            metrics: ExecutionPlanMetricsSet::new(),
            runs: Arc::new((0..n).map(|_| Mutex::new(None)).collect()),
            row_fraction: None,
            limit: None,
            key_filters: Vec::new(),
            direct: false,
            pinned: false,
        }
    }

    /// Every fragment names its partition's objects as planned, and a node whose
    /// partition has changed since refuses it (see [`SqlFragment::objects`]): for
    /// plans that rely on the objects' statistics.
    pub fn pinned(mut self) -> Self {
        self.pinned = true;
        self
    }

    /// A scan that reduces nothing by itself (no filter, no limit): without a
    /// join-key filter it reads the Parquet objects by byte range here (compressed
    /// column chunks are smaller than the same columns as Arrow IPC, and the nodes'
    /// CPUs are spared); with one, it asks the nodes, which hand it back when the
    /// filter keeps more than [`DIRECT_ABOVE`] of the rows.
    pub fn direct(mut self) -> Self {
        self.direct = true;
        self
    }

    /// The same scan, also filtered by the keys `collector` gathers on output
    /// `columns` (see [`crate::semijoin`]).
    pub fn with_key_filter(&self, collector: Arc<KeyCollector>, columns: Vec<usize>) -> Self {
        let mut s = CsdScanExec::new(
            self.table.clone(),
            self.schema.clone(),
            self.plan.as_ref().clone(),
            self.mode,
            self.describe.clone(),
        )
        .with_estimate(self.row_fraction, self.limit);
        s.direct = self.direct;
        s.pinned = self.pinned;
        s.key_filters = self.key_filters.clone();
        s.key_filters.push((collector, columns));
        s
    }

    /// Whether the scan reduces nothing by itself (see [`CsdScanExec::direct`]).
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Whether a join-key filter is attached.
    pub fn has_key_filter(&self) -> bool {
        !self.key_filters.is_empty()
    }

    /// The output columns of each attached join-key filter.
    pub fn key_filter_columns(&self) -> Vec<Vec<usize>> {
        self.key_filters.iter().map(|(_, c)| c.clone()).collect()
    }

    /// What the nodes return.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Estimates rows as `fraction` of the endpoints' rows, at most `limit` per
    /// endpoint (for the optimizer; `None` fraction: unknown).
    pub fn with_estimate(mut self, fraction: Option<f64>, limit: Option<usize>) -> Self {
        self.row_fraction = fraction;
        self.limit = limit;
        self
    }

    /// What each endpoint did in the last execution (those that finished).
    pub fn runs(&self) -> Vec<EndpointRun> {
        self.runs
            .iter()
            .filter_map(|r| r.lock().ok().and_then(|g| g.clone()))
            .collect()
    }

    /// Table scanned.
    pub fn table(&self) -> &CsdTable {
        &self.table
    }
}

impl DisplayAs for CsdScanExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let mode = match self.mode {
            Mode::Complete => "rows",
            Mode::PartialAggregate => "partial aggregate",
        };
        let eps: Vec<String> = self
            .table
            .endpoints()
            .iter()
            .map(|e| format!("{}/{}", e.client.url(), e.partition))
            .collect();
        match t {
            DisplayFormatType::TreeRender => {
                writeln!(f, "table={}", self.table.name())?;
                writeln!(f, "returns={mode}")?;
                write!(f, "endpoints={}", eps.len())
            }
            _ => {
                write!(
                    f,
                    "CsdScanExec: table={}, returns={mode}, pushed=[{}], endpoints=[{}]",
                    self.table.name(),
                    self.describe,
                    eps.join(", ")
                )?;
                if self.direct {
                    write!(f, ", direct=byte ranges unless a key filter applies")?;
                }
                if self.pinned {
                    write!(f, ", pinned=objects as planned")?;
                }
                for (c, cols) in &self.key_filters {
                    let names: Vec<&str> = cols
                        .iter()
                        .map(|&i| self.schema.field(i).name().as_str())
                        .collect();
                    write!(
                        f,
                        ", key_filter=[{}] from a hash join's build side",
                        names.join(", ")
                    )?;
                    if c.keys() > 0 {
                        write!(f, " ({} keys)", c.keys())?;
                    }
                }
                let runs = self.runs();
                if !runs.is_empty() {
                    let per: Vec<String> = runs
                        .iter()
                        .map(|r| {
                            if let Some(why) = &r.pushed_back {
                                return format!("{}: pushed_back ({why})", r.endpoint);
                            }
                            if r.direct {
                                return format!("{}: read here by byte range", r.endpoint);
                            }
                            format!(
                                "{}: device_read={} sent={} rows_scanned={} rows_returned={} node_time={:.1}ms",
                                r.endpoint,
                                r.report.bytes_read,
                                r.report.bytes_sent,
                                r.report.rows_scanned,
                                r.report.rows_returned,
                                r.report.elapsed_us as f64 / 1000.0
                            )
                        })
                        .collect();
                    write!(f, ", at_nodes=[{}]", per.join("; "))?;
                }
                Ok(())
            }
        }
    }
}

impl ExecutionPlan for CsdScanExec {
    fn name(&self) -> &str {
        "CsdScanExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.props
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn replace_children(
        self: Arc<Self>,
        _: Vec<Arc<dyn ExecutionPlan>>,
        _: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(self)
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.replace_children(
            children,
            ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute),
        )
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let schema = self.schema.clone();
        let Some(ep) = self.table.endpoints().get(partition).cloned() else {
            // A table with no partitions anywhere: one empty partition.
            return Ok(Box::pin(RecordBatchStreamAdapter::new(
                schema,
                futures::stream::empty(),
            )));
        };
        let base = SqlFragment {
            table: self.table.name().to_string(),
            partition: Some(ep.partition.clone()),
            plan: self.plan.as_ref().clone(),
            mode: self.mode as i32,
            key_filters: vec![],
            direct_above: self.direct.then_some(DIRECT_ABOVE),
            objects: if self.pinned {
                ep.objects.iter().map(|o| o.name.clone()).collect()
            } else {
                vec![]
            },
        };
        let compression = self.table.compression();
        let output_rows = MetricBuilder::new(&self.metrics).output_rows(partition);
        let received = MetricBuilder::new(&self.metrics).counter("bytes_received", partition);
        let node_read = MetricBuilder::new(&self.metrics).counter("node_bytes_read", partition);
        let node_scanned =
            MetricBuilder::new(&self.metrics).counter("node_rows_scanned", partition);
        let pushed_back = MetricBuilder::new(&self.metrics).counter("pushed_back", partition);
        let slot = self.runs.clone();
        if let Some(m) = slot.get(partition)
            && let Ok(mut g) = m.lock()
        {
            *g = None;
        }
        let out_schema = schema.clone();
        let endpoint = format!("{}/{}", ep.client.url(), ep.partition);
        let table = self.table.clone();
        let key_filters = self.key_filters.clone();
        let direct = self.direct;
        let open = async move {
            // With join-key filters, first the build sides' keys.
            let mut frag = base;
            for (collector, cols) in &key_filters {
                if let Some(bloom) = collector.wait().await {
                    frag.key_filters.push(bloom.to_msg(cols));
                }
            }
            let args = frag.to_bytes();
            let record = move |run: EndpointRun| {
                if let Some(m) = slot.get(partition)
                    && let Ok(mut g) = m.lock()
                {
                    *g = Some(run);
                }
            };
            let local = |here: SendableRecordBatchStream| {
                let out = out_schema.clone();
                let output_rows = output_rows.clone();
                here.map(move |b| {
                    let b = b?;
                    output_rows.add(b.num_rows());
                    relabel(b, &out)
                })
                .boxed()
            };
            if direct && frag.key_filters.is_empty() {
                let here = evaluate_here(&table, &ep, &args, &context, false).await?;
                record(EndpointRun {
                    endpoint,
                    direct: true,
                    ..Default::default()
                });
                return Ok(local(here));
            }
            // Saturated here too: ask the node to queue it instead of handing it
            // back (once more if it was handed back and this tier filled up since).
            let gate = table.local_gate().clone();
            let mut patient = gate.saturated() && !direct;
            let reply = loop {
                let r = ep
                    .client
                    .operator_with(OPERATOR_NAME, args.clone(), compression, patient)
                    .await;
                match r {
                    Err(ClientError::PushedBack(_)) if !patient && !direct && gate.saturated() => {
                        patient = true;
                    }
                    r => break r,
                }
            };
            let refused = match reply {
                Ok(reply) => {
                    // A node that runs out of memory fails before its first batch:
                    // that too is evaluated here rather than failing the query.
                    let mut batches = reply.batches;
                    match batches.next().await {
                        Some(Err(e)) if e.code() == Some(tonic::Code::ResourceExhausted) => {
                            Err(e.to_string())
                        }
                        first => Ok((first, batches, reply.stats)),
                    }
                }
                Err(ClientError::PushedBack(p)) => Err(p.reason),
                Err(e) => return Err(to_datafusion(e)),
            };
            let (first, rest, stats) = match refused {
                Ok(x) => x,
                Err(why) => {
                    // A direct scan handed back reads as it would have without a
                    // filter: not one of the fragments the gate orders.
                    let here = evaluate_here(&table, &ep, &args, &context, !direct).await?;
                    record(EndpointRun {
                        endpoint,
                        pushed_back: Some(why),
                        direct,
                        ..Default::default()
                    });
                    pushed_back.add(1);
                    return Ok(local(here));
                }
            };
            let batches = futures::stream::iter(first).chain(rest).map(move |b| {
                let b = b.map_err(to_datafusion)?;
                output_rows.add(b.num_rows());
                relabel(b, &out_schema)
            });
            let done = futures::stream::once(async move {
                let bytes = stats
                    .bytes_received
                    .load(std::sync::atomic::Ordering::Relaxed);
                received.add(bytes as usize);
                let report = stats.report().unwrap_or_default();
                node_read.add(report.bytes_read as usize);
                node_scanned.add(report.rows_scanned as usize);
                record(EndpointRun {
                    endpoint,
                    bytes_received: bytes,
                    report,
                    ..Default::default()
                });
                None
            })
            .filter_map(futures::future::ready);
            Ok::<_, DataFusionError>(batches.chain(done).boxed())
        };
        let stream = futures::stream::once(open).try_flatten();
        // Started now, not when first polled: a hash join polls its probe side only
        // after building, so scans on both sides (and on either side of nested
        // joins) would otherwise run one after another at the node. At most
        // `PREFETCH_BATCHES` wait here; the task ends when the stream is dropped.
        // A key-filtered scan starts when polled, as before: its keys are complete
        // by then, and its wait for them (bounded by `semijoin::WAIT`) should not
        // count the build side's own run time.
        if !self.key_filters.is_empty() || tokio::runtime::Handle::try_current().is_err() {
            return Ok(Box::pin(RecordBatchStreamAdapter::new(schema, stream)));
        }
        let mut b = RecordBatchReceiverStream::builder(schema, PREFETCH_BATCHES);
        let tx = b.tx();
        b.spawn(async move {
            let mut stream = std::pin::pin!(stream);
            while let Some(item) = stream.next().await {
                if tx.send(item).await.is_err() {
                    break;
                }
            }
            Ok(())
        });
        Ok(b.build())
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn partition_statistics(&self, partition: Option<usize>) -> Result<Arc<Statistics>> {
        // Row estimates let DataFusion order joins: the endpoints' rows scaled by the
        // same default selectivity its FilterExec assumes; unknown for aggregates.
        let eps = self.table.endpoints();
        let rows: u64 = match partition {
            Some(p) => eps.get(p).map(|e| e.rows).unwrap_or(0),
            None => eps.iter().map(|e| e.rows).sum(),
        };
        let mut stats = Statistics::new_unknown(&self.schema);
        if let Some(f) = self.row_fraction {
            let mut n = (rows as f64 * f) as usize;
            if let Some(l) = self.limit {
                n = n.min(l);
            }
            stats = stats.with_num_rows(Precision::Inexact(n));
        }
        Ok(Arc::new(stats))
    }
}

/// Evaluates a fragment the node pushed back: the same plan, run here by DataFusion
/// over the endpoint's Parquet objects read by byte range (the query's runtime: its
/// memory pool, object stores and footer cache).
async fn evaluate_here(
    table: &CsdTable,
    ep: &Endpoint,
    args: &[u8],
    context: &TaskContext,
    gated: bool,
) -> Result<SendableRecordBatchStream> {
    let (frag, mode, plan) =
        SqlFragment::decode_checked(args).map_err(|e| DataFusionError::External(Box::new(e)))?;
    let provider = Arc::new(table.range_table(std::slice::from_ref(ep)));
    let session = fragment_session(
        context.runtime_env(),
        &frag.table,
        provider,
        Parallelism::ONE,
    )
    .map_err(|e| DataFusionError::External(Box::new(e)))?;
    let physical = plan_fragment(&session, &frag.table, &plan, mode)
        .await
        .map_err(|e| DataFusionError::External(Box::new(e)))?;
    let (physical, filters) =
        key_filtered(&frag, physical).map_err(|e| DataFusionError::External(Box::new(e)))?;
    let stream = filter_stream(physical.execute(0, session.task_ctx())?, filters);
    Ok(if gated {
        table.local_gate().run(stream)
    } else {
        stream
    })
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
