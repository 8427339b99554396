//! `CsdScanExec`: the compute-side leaf that runs a pushed fragment on every endpoint
//! (one output partition per node partition, read in parallel) and collects what each
//! node reports, for `EXPLAIN ANALYZE` and the byte counts of `csd sql`.
//!
//! As DataFusion's `FileStream`: [`CsdScanExec::execute`] builds an opener
//! (`opener.rs`: join keys, the node request, pushback to local evaluation) and a
//! stream state machine (`stream.rs`) over it, with its counters in `metrics.rs`.

pub(crate) mod codec;
mod metrics;
pub(crate) mod opener;
mod run;
mod stream;

use std::fmt;
use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use csd_protocol::node_client::{Declined, Tried};
use datafusion::common::stats::Precision;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{Result, Statistics};
use datafusion::execution::TaskContext;
use datafusion::physical_expr::EquivalenceProperties;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricsSet};
use datafusion::physical_plan::stream::{RecordBatchReceiverStream, RecordBatchStreamAdapter};
use datafusion::physical_plan::{
    ChildrenPropertiesMode, DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning,
    PhysicalExpr, PlanProperties, ReplaceChildrenOptions, SendableRecordBatchStream,
};
use futures::StreamExt;

use crate::compute::endpoints::{Endpoint, TableEndpoints};
use crate::compute::key_collector::KeyCollector;
use crate::options::CsdOptions;
use crate::wire::fragment::{Mode, SqlFragment};
use crate::wire::shipped::ShippedFunction;
pub(crate) use metrics::ScanCounter;
use metrics::ScanMetrics;
use opener::EndpointOpener;
pub use run::EndpointRun;
use stream::{EndpointStream, RunSlot};

/// Runs a pushed fragment on all endpoints of a table.
#[derive(Debug)]
pub struct CsdScanExec {
    table: Arc<TableEndpoints>,
    schema: SchemaRef,
    plan: Arc<Vec<u8>>,
    mode: Mode,
    describe: String,
    props: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
    runs: Arc<Vec<RunSlot>>,
    row_fraction: Option<f64>,
    limit: Option<usize>,
    key_filters: Vec<(Arc<KeyCollector>, Vec<usize>)>,
    direct: bool,
    pinned: bool,
    functions: Arc<Vec<Arc<ShippedFunction>>>,
    /// For each output column, the table column it passes through unchanged, when
    /// the fragment only filters and projects (see [`CsdScanExec::with_table_columns`]).
    table_columns: Option<Arc<Vec<usize>>>,
    /// A partial aggregate judged at the nodes (see [`CsdScanExec::judged_at_nodes`]).
    shrink_above: Option<f32>,
    /// Filter while decoding (see [`CsdScanExec::late_filters`]).
    late_filters: bool,
    /// State its fragments hold at the node (see [`CsdScanExec::holding`]).
    state_bytes: Option<u64>,
}

impl CsdScanExec {
    /// A scan of `table` answering `schema`, running Substrait `plan` in `mode`;
    /// `describe` is what EXPLAIN shows as pushed.
    pub fn new(
        table: Arc<TableEndpoints>,
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
            runs: Arc::new((0..n).map(|_| RunSlot::default()).collect()),
            row_fraction: None,
            limit: None,
            key_filters: Vec::new(),
            direct: false,
            pinned: false,
            functions: Arc::new(Vec::new()),
            table_columns: None,
            shrink_above: None,
            late_filters: false,
            state_bytes: None,
        }
    }

    /// A partial aggregate that could not be judged before running (no distinct-count
    /// sketches): each node hands it back when a stream's first rows hold more groups
    /// than `fraction` of them (see [`SqlFragment::shrink_above`]).
    pub(crate) fn judged_at_nodes(mut self, fraction: f32) -> Self {
        self.shrink_above = Some(fraction);
        self
    }

    /// The same scan with `partitions` output partitions (the endpoints' count at
    /// least; the rest are empty): every task of a distributed stage answers with as
    /// many.
    pub(crate) fn with_partitions(mut self, partitions: usize) -> Self {
        let n = self.table.endpoints().len().max(partitions).max(1);
        let props = self
            .props
            .as_ref()
            .clone()
            .with_partitioning(Partitioning::UnknownPartitioning(n));
        self.props = Arc::new(props);
        self.runs = Arc::new((0..n).map(|_| RunSlot::default()).collect());
        self
    }

    /// The same scan over `endpoints` only (a share of a distributed stage), with
    /// `partitions` output partitions.
    pub(crate) fn with_endpoints(&self, endpoints: Vec<Endpoint>, partitions: usize) -> Self {
        self.over(Arc::new(self.table.with_endpoints(endpoints)), partitions)
    }

    /// The same scan over `table`, with `partitions` output partitions and no runs.
    fn over(&self, table: Arc<TableEndpoints>, partitions: usize) -> Self {
        let mut s = CsdScanExec::new(
            table,
            self.schema.clone(),
            self.plan.as_ref().clone(),
            self.mode,
            self.describe.clone(),
        )
        .with_estimate(self.row_fraction, self.limit)
        .with_partitions(partitions);
        s.direct = self.direct;
        s.pinned = self.pinned;
        s.functions = self.functions.clone();
        s.key_filters = self.key_filters.clone();
        s.table_columns = self.table_columns.clone();
        s.shrink_above = self.shrink_above;
        s.late_filters = self.late_filters;
        s.state_bytes = self.state_bytes;
        s
    }

    /// Output column `i` is the table's column `columns[i]`, unchanged (a fragment
    /// that filters and projects): a join-key filter on it can be cut to the key
    /// ranges of each node's objects (see [`crate::wire::keyfilter`]).
    pub(crate) fn with_table_columns(mut self, columns: Vec<usize>) -> Self {
        self.table_columns = Some(Arc::new(columns));
        self
    }

    /// The Wasm SQL functions the plan calls: declared in every fragment (their
    /// modules sent to a node that lacks them).
    pub fn with_functions(mut self, functions: Vec<Arc<ShippedFunction>>) -> Self {
        self.functions = Arc::new(functions);
        self
    }

    /// What opens partition `endpoint`'s share of the scan.
    pub(crate) fn opener(
        &self,
        endpoint: crate::compute::endpoints::Endpoint,
        context: Arc<TaskContext>,
    ) -> EndpointOpener {
        let options = CsdOptions::of(context.session_config().options());
        let fragment = SqlFragment {
            table: self.table.name().to_string(),
            partition: endpoint
                .merged
                .is_empty()
                .then(|| endpoint.partition.clone()),
            plan: self.plan.as_ref().clone(),
            mode: self.mode as i32,
            key_filters: vec![],
            direct_above: self.direct.then_some(options.direct_above as f32),
            objects: if self.pinned {
                endpoint.objects.iter().map(|o| o.name.clone()).collect()
            } else {
                vec![]
            },
            functions: self.functions.iter().map(|f| f.to_msg()).collect(),
            partitions: endpoint.merged.clone(),
            shrink_above: self.shrink_above,
            output_schema: SqlFragment::encode_schema(&self.schema),
            late_filters: self.late_filters,
            state_bytes: self.state_bytes,
        };
        EndpointOpener {
            table: self.table.clone(),
            endpoint,
            fragment,
            key_filters: self.key_filters.clone(),
            table_columns: self.table_columns.clone(),
            direct: self.direct,
            here: None,
            functions: self.functions.clone(),
            context,
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
    /// filter keeps more than `csd.direct_above` of the rows.
    pub fn direct(mut self) -> Self {
        self.direct = true;
        self
    }

    /// Its fragments filter while decoding (Parquet late materialization): for a
    /// filter expected to keep so few rows that most pages hold none of them, in a
    /// read of many more columns than the filter's (see [`SqlFragment::late_filters`]).
    pub(crate) fn late_filters(mut self) -> Self {
        self.late_filters = true;
        self
    }

    /// Its fragments hold about `bytes` of state at the node (a part run whole),
    /// which the node's admission reserves (see [`SqlFragment::state_bytes`]).
    pub(crate) fn holding(mut self, bytes: Option<u64>) -> Self {
        self.state_bytes = bytes;
        self
    }

    /// The same scan, also filtered by the keys `collector` gathers on output
    /// `columns` (see [`crate::compute::key_filter_rule`]).
    pub(crate) fn with_key_filter(
        &self,
        collector: Arc<KeyCollector>,
        columns: Vec<usize>,
    ) -> Self {
        let mut s = self.over(self.table.clone(), self.runs.len());
        s.key_filters.push((collector, columns));
        s
    }

    /// Whether the scan reduces nothing by itself (see [`CsdScanExec::direct`]).
    pub(crate) fn is_direct(&self) -> bool {
        self.direct
    }

    /// Whether a join-key filter is attached.
    pub(crate) fn has_key_filter(&self) -> bool {
        !self.key_filters.is_empty()
    }

    /// The collectors of the join-key filters it waits on.
    pub(crate) fn key_collectors(&self) -> impl Iterator<Item = &Arc<KeyCollector>> {
        self.key_filters.iter().map(|(c, _)| c)
    }

    /// The output columns of each join-key filter it waits on.
    pub(crate) fn key_filter_columns(&self) -> Vec<Vec<usize>> {
        self.key_filters.iter().map(|(_, c)| c.clone()).collect()
    }

    /// What the nodes return.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Estimates rows as `fraction` of the endpoints' rows, at most `limit` per
    /// endpoint (for the optimizer; `None` fraction: unknown).
    pub(crate) fn with_estimate(mut self, fraction: Option<f64>, limit: Option<usize>) -> Self {
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
    pub fn table(&self) -> &TableEndpoints {
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
                if self.late_filters {
                    write!(f, ", late_filters=filtered while decoding")?;
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
                    let cut = c.cut_keys();
                    if !cut.is_empty() {
                        let each: Vec<String> = cut.iter().map(|k| k.to_string()).collect();
                        write!(f, " cut to nodes' key ranges ({} keys)", each.join(", "))?;
                    }
                }
                let runs = self.runs();
                if !runs.is_empty() {
                    let per: Vec<String> = runs
                        .iter()
                        .map(|r| {
                            let per = render_run(r);
                            match r.failed_over.is_empty() {
                                true => per,
                                false => format!("{per} (after {})", Tried::list(&r.failed_over)),
                            }
                        })
                        .collect();
                    write!(f, ", at_nodes=[{}]", per.join("; "))?;
                }
                Ok(())
            }
        }
    }
}

/// What one endpoint did, for `EXPLAIN ANALYZE`.
fn render_run(r: &EndpointRun) -> String {
    match &r.pushed_back {
        Some(why @ Declined::Lost(_)) => {
            return format!("{}: read here from the copies ({why})", r.endpoint);
        }
        Some(why @ Declined::Unable(_)) => return format!("{}: pushed_back ({why})", r.endpoint),
        Some(why) => return format!("{}: pushed_back ({})", r.endpoint, why.reason()),
        None => {}
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
        let Some(endpoint) = self.table.endpoints().get(partition).cloned() else {
            // A table with no partitions anywhere: one empty partition.
            return Ok(Box::pin(RecordBatchStreamAdapter::new(
                schema,
                futures::stream::empty(),
            )));
        };
        let options = CsdOptions::of(context.session_config().options());
        let opener = self.opener(endpoint, context);
        let run = self.runs.get(partition).cloned().unwrap_or_default();
        let metrics = ScanMetrics::new(&self.metrics, partition);
        let stream = EndpointStream::new(opener, schema.clone(), metrics, run);
        // Started now, not when first polled: a hash join polls its probe side only
        // after building, so scans on both sides (and on either side of nested
        // joins) would otherwise run one after another at the node. At most
        // `csd.prefetch_batches` wait here; the task ends when the stream is
        // dropped. A key-filtered scan starts when polled: its keys are complete by
        // then, and its wait for them (`csd.key_wait_secs`) should not count the
        // build side's own run time.
        if !self.key_filters.is_empty() || tokio::runtime::Handle::try_current().is_err() {
            return Ok(Box::pin(stream));
        }
        let mut b = RecordBatchReceiverStream::builder(schema, options.prefetch_batches.max(1));
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

/// The one scan under `plan`, if the plan is nothing but that scan (and renaming);
/// else the first operator that runs at the compute tier.
pub(crate) fn only_scan(
    plan: &Arc<dyn ExecutionPlan>,
) -> std::result::Result<&CsdScanExec, StaysHere> {
    if let Some(scan) = plan.downcast_ref::<CsdScanExec>() {
        return Ok(scan);
    }
    match (plan.name(), plan.children().as_slice()) {
        (
            "ProjectionExec" | "CoalesceBatchesExec" | "CooperativeExec" | "RepartitionExec",
            [child],
        ) => only_scan(child),
        (name, _) => Err(StaysHere(name.to_string())),
    }
}

/// An operator of a plan that runs at the compute tier (by its name, as `EXPLAIN`
/// shows it), where a plan pushed whole to the nodes was wanted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StaysHere(pub(crate) String);

impl fmt::Display for StaysHere {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
