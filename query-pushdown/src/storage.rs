//! Storage side: the `"sql"` operator. Decodes and validates a [`SqlFragment`], plans
//! it with DataFusion over the node's own Parquet objects (footers and page indexes
//! come from the node's in-memory catalog, reads go straight to the object store and
//! are counted), and streams the result on the node's CPU pool under its memory pool.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use arrow::datatypes::{DataType, SchemaRef};
use async_trait::async_trait;
use bytes::Bytes;
use csd_runtime::admission::PushBack;
use csd_runtime::operator::{Estimate, Operator, OperatorContext, OperatorStream};
use csd_runtime::store::ObjectStore as NodeObjects;
use csd_runtime::table::{ObjectReader, ParquetObject};
use csd_runtime::{Error, Result};
use datafusion::catalog::Session;
use datafusion::common::DataFusionError;
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::parquet::ParquetFileReaderFactory;
use datafusion::datasource::{TableProvider, TableType};
use datafusion::execution::SessionStateBuilder;
use datafusion::execution::memory_pool::{GreedyMemoryPool, MemoryPool, TrackConsumersPool};
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};
use datafusion::logical_expr::{Expr, LogicalPlan, TableProviderFilterPushDown, Volatility};
use datafusion::parquet::arrow::ProjectionMask;
use datafusion::parquet::arrow::async_reader::AsyncFileReader;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    ExecutionPlan, ExecutionPlanProperties, SendableRecordBatchStream,
};
use datafusion::prelude::{SessionConfig, SessionContext};
use datafusion_substrait::logical_plan::consumer::from_substrait_plan;
use datafusion_substrait::substrait::proto::Plan;
use futures::{FutureExt, StreamExt};

use crate::error::to_runtime;
use crate::fragment::{Mode, OPERATOR_NAME, SqlFragment, validate};
use crate::keyfilter::{self, KeyFilter};
use crate::scan;

/// Object-store URL the node's scans use (reads go through [`NodeReaderFactory`]).
const NODE_URL: &str = "csd-node://local";

/// Substrait names the DataFusion consumer maps to operators and builtins (not in
/// the function registry by these names).
const BUILTINS: &[&str] = &[
    "and",
    "or",
    "not",
    "xor",
    "and_not",
    "equal",
    "not_equal",
    "lt",
    "lte",
    "gt",
    "gte",
    "add",
    "subtract",
    "multiply",
    "divide",
    "modulus",
    "mod",
    "negate",
    "like",
    "ilike",
    "is_null",
    "is_not_null",
    "is_true",
    "is_false",
    "is_not_true",
    "is_not_false",
    "is_unknown",
    "is_not_unknown",
    "is_distinct_from",
    "is_not_distinct_from",
    "between",
    "bitwise_and",
    "bitwise_or",
    "bitwise_xor",
    "shift_left",
    "shift_right",
    "concat",
    "string_concat",
    "extract",
];

/// The `"sql"` operator.
#[derive(Default)]
pub struct SqlOperator {
    memory: OnceLock<Arc<dyn MemoryPool>>,
}

impl SqlOperator {
    /// A new operator (its memory pool is sized from the node's budget on first use).
    pub fn new() -> Self {
        Self::default()
    }

    fn pool(&self, budget: u64) -> Arc<dyn MemoryPool> {
        self.memory
            .get_or_init(|| {
                Arc::new(TrackConsumersPool::new(
                    GreedyMemoryPool::new(budget as usize),
                    std::num::NonZeroUsize::new(3).unwrap_or(std::num::NonZeroUsize::MIN),
                ))
            })
            .clone()
    }
}

/// The physical optimizer rules fragments are planned with: DataFusion's, without
/// the one that would merge the partial/final aggregate split a fragment needs.
fn fragment_rules() -> Vec<Arc<dyn PhysicalOptimizerRule + Send + Sync>> {
    static RULES: OnceLock<Vec<Arc<dyn PhysicalOptimizerRule + Send + Sync>>> = OnceLock::new();
    RULES
        .get_or_init(|| {
            SessionStateBuilder::new()
                .with_default_features()
                .build()
                .physical_optimizers()
                .iter()
                .filter(|r| r.name() != "CombinePartialFinalAggregate")
                .cloned()
                .collect()
        })
        .clone()
}

/// A session for running one fragment over `table` = `provider`, on one partition
/// (one CPU slot), with `runtime`'s memory pool and object stores. The node runs
/// fragments in it; so does the compute tier when a node pushes one back.
pub(crate) fn fragment_session(
    runtime: Arc<RuntimeEnv>,
    table: &str,
    provider: Arc<dyn TableProvider>,
) -> Result<SessionContext> {
    let config = scan::configure(
        SessionConfig::new()
            .with_target_partitions(1)
            .with_batch_size(8192),
    );
    let state = SessionStateBuilder::new()
        .with_default_features()
        .with_config(config)
        .with_runtime_env(runtime)
        .with_physical_optimizer_rules(fragment_rules())
        .build();
    let session = SessionContext::new_with_state(state);
    session
        .register_table(table, provider)
        .map_err(to_runtime)?;
    Ok(session)
}

/// Validates `plan` (a fragment over `table` in `mode`) against what `session` can
/// run exactly, and plans it: the output is one partition, partial aggregate states
/// in [`Mode::PartialAggregate`].
pub(crate) async fn plan_fragment(
    session: &SessionContext,
    table: &str,
    plan: &Plan,
    mode: Mode,
) -> Result<Arc<dyn ExecutionPlan>> {
    let state = session.state();
    let registry_ok = |name: &str| {
        BUILTINS.contains(&name)
            || state
                .scalar_functions()
                .get(name)
                .is_some_and(|f| f.signature().volatility != Volatility::Volatile)
    };
    validate(plan, table, &registry_ok)?;
    // Defence in depth: the checks above bound what reaches DataFusion's consumer;
    // should it still panic on some inconsistent plan, refuse the plan, not the node.
    let logical = std::panic::AssertUnwindSafe(from_substrait_plan(&state, plan))
        .catch_unwind()
        .await
        .map_err(|_| {
            Error::InvalidArgument(
                "the Substrait plan is inconsistent and cannot be planned".into(),
            )
        })?
        .map_err(|e| Error::InvalidArgument(format!("cannot plan the fragment: {e}")))?;
    check_logical(&logical, mode)?;
    let physical = state
        .create_physical_plan(&logical)
        .await
        .map_err(to_runtime)?;
    let physical = match mode {
        Mode::Complete => physical,
        Mode::PartialAggregate => partial_of(physical)?,
    };
    Ok(if physical.output_partitioning().partition_count() > 1 {
        Arc::new(CoalescePartitionsExec::new(physical))
    } else {
        physical
    })
}

/// The objects of `frag`'s table (or partition) at this node.
fn objects_of(
    ctx: &OperatorContext,
    frag: &SqlFragment,
) -> Result<(SchemaRef, Vec<ParquetObject>)> {
    let table = ctx.node.tables.table(&frag.table)?;
    let objects: Vec<ParquetObject> = match &frag.partition {
        Some(p) => table
            .partitions
            .get(p)
            .cloned()
            .ok_or_else(|| Error::NotFound(format!("partition {p} of table {}", frag.table)))?,
        None => table.partitions.values().flatten().cloned().collect(),
    };
    if !frag.objects.is_empty() {
        let mut have: Vec<&str> = objects.iter().map(|o| o.object.name.as_str()).collect();
        let mut want: Vec<&str> = frag.objects.iter().map(String::as_str).collect();
        have.sort_unstable();
        want.sort_unstable();
        if have != want {
            return Err(Error::FailedPrecondition(format!(
                "table {} changed since the query was planned ({} objects now, {} then); \
                 plan the query again",
                frag.table,
                have.len(),
                want.len()
            )));
        }
    }
    Ok((table.schema.clone(), objects))
}

#[async_trait]
impl Operator for SqlOperator {
    fn name(&self) -> &'static str {
        OPERATOR_NAME
    }

    /// Bytes: the compressed column chunks of the columns the fragment reads, in
    /// every row group (pruning is left to the learned per-byte cost, which absorbs
    /// its average effect). Memory: four times the largest row group's share (the
    /// chunks, decompressed pages, decoded batches) plus 16 MiB for batches and
    /// aggregation state.
    async fn estimate(&self, ctx: &OperatorContext, args: &Bytes) -> Result<Estimate> {
        let (frag, _mode, plan) = SqlFragment::decode_checked(args)?;
        let (_, objects) = objects_of(ctx, &frag)?;
        let columns = read_columns(&plan);
        let mut bytes = 0u64;
        let mut largest = 0u64;
        for o in &objects {
            let meta = o.metadata.metadata();
            let mask = match &columns {
                Some(c) => {
                    ProjectionMask::roots(meta.file_metadata().schema_descr(), c.iter().copied())
                }
                None => ProjectionMask::all(),
            };
            for rg in meta.row_groups() {
                let b: u64 = rg
                    .columns()
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| mask.leaf_included(*i))
                    .map(|(_, c)| c.compressed_size().max(0) as u64)
                    .sum();
                bytes += b;
                largest = largest.max(b);
            }
        }
        Ok(Estimate {
            bytes,
            memory: 4 * largest + (16 << 20),
        })
    }

    async fn open(&self, ctx: OperatorContext, args: Bytes) -> Result<OperatorStream> {
        let (frag, mode, plan) = SqlFragment::decode_checked(&args)?;
        let (schema, objects) = objects_of(&ctx, &frag)?;
        let runtime = RuntimeEnvBuilder::new()
            .with_memory_pool(self.pool(ctx.node.memory_budget))
            .build_arc()
            .map_err(to_runtime)?;
        let url = ObjectStoreUrl::parse(NODE_URL).map_err(to_runtime)?;
        // Never read: every read goes through the reader factory below.
        runtime.register_object_store(
            url.as_ref(),
            Arc::new(object_store::memory::InMemory::new()),
        );
        let provider = NodeTable {
            schema,
            objects: objects
                .iter()
                .map(|o| (o.object.name.clone(), o.clone()))
                .collect(),
            store: ctx.node.tables.object_store().clone(),
            bytes_read: ctx.metrics.bytes_read.clone(),
        };
        let session = fragment_session(runtime, &frag.table, Arc::new(provider))?;
        let physical = plan_fragment(&session, &frag.table, &plan, mode).await?;
        let schema: SchemaRef = physical.schema();
        let filters = key_filters(&frag, &schema)?;
        let unfiltered = physical
            .execute(0, session.task_ctx())
            .map_err(to_runtime)?;
        let stream = match frag.direct_above.filter(|_| !filters.is_empty()) {
            Some(most) => judged(unfiltered, filters, most).await?,
            None => filter_stream(unfiltered, filters),
        };
        let metrics = ctx.metrics.clone();
        let done = futures::stream::once(async move {
            metrics
                .rows_scanned
                .fetch_add(rows_scanned(&physical), Ordering::Relaxed);
            None
        })
        .filter_map(futures::future::ready);
        let batches = stream.map(|b| b.map_err(to_runtime)).chain(done).boxed();
        Ok(OperatorStream { schema, batches })
    }

    fn memory_used(&self) -> u64 {
        self.memory.get().map(|p| p.reserved() as u64).unwrap_or(0)
    }
}

/// The fragment's join-key filters, checked against its output `schema`.
pub(crate) fn key_filters(frag: &SqlFragment, schema: &SchemaRef) -> Result<Vec<KeyFilter>> {
    let types: Vec<DataType> = schema
        .fields()
        .iter()
        .map(|f| f.data_type().clone())
        .collect();
    frag.key_filters
        .iter()
        .map(|m| KeyFilter::from_msg(m, &types).map_err(Error::InvalidArgument))
        .collect()
}

/// `stream` without the rows `filters` rule out (counted as `key_filtered` rows).
pub(crate) fn filter_stream(
    stream: SendableRecordBatchStream,
    filters: Vec<KeyFilter>,
) -> SendableRecordBatchStream {
    if filters.is_empty() {
        return stream;
    }
    let schema = stream.schema();
    let filtered = stream.map(move |b| {
        let b = b?;
        keyfilter::apply_all(&filters, b)
            .map_err(|e| DataFusionError::Execution(format!("join-key filter: {e}")))
    });
    Box::pin(RecordBatchStreamAdapter::new(schema, filtered))
}

/// Rows of the fragment a direct scan's filter is judged on.
const JUDGE_ROWS: usize = 8192;

/// `stream` filtered, or handed back when the filters keep more than `most` of the
/// fragment's first [`JUDGE_ROWS`] rows: for a scan that reduces nothing else,
/// reading the Parquet directly then moves fewer bytes than the survivors as Arrow
/// IPC.
async fn judged(
    mut stream: SendableRecordBatchStream,
    filters: Vec<KeyFilter>,
    most: f32,
) -> Result<SendableRecordBatchStream> {
    let schema = stream.schema();
    let (mut seen, mut kept, mut head) = (0usize, 0usize, Vec::new());
    while seen < JUDGE_ROWS {
        let Some(b) = stream.next().await else { break };
        let b = b.map_err(to_runtime)?;
        seen += b.num_rows();
        let b = keyfilter::apply_all(&filters, b).map_err(Error::Internal)?;
        kept += b.num_rows();
        head.push(Ok(b));
    }
    if seen > 0 && kept as f64 > f64::from(most) * seen as f64 {
        return Err(Error::PushedBack(PushBack {
            reason: format!(
                "the join-key filter keeps {:.0}% of the first {seen} rows (more than {:.0}%): reading the Parquet directly moves fewer bytes",
                100.0 * kept as f64 / seen as f64,
                100.0 * most
            ),
            predicted_delay_ms: 0.0,
            estimate_ms: 0.0,
        }));
    }
    let rest = filter_stream(stream, filters);
    Ok(Box::pin(RecordBatchStreamAdapter::new(
        schema,
        futures::stream::iter(head).chain(rest),
    )))
}

/// The table columns a fragment's read relation names (its projection, which
/// DataFusion's producer makes include the columns its filters use); `None`: all.
fn read_columns(plan: &Plan) -> Option<Vec<usize>> {
    use datafusion_substrait::substrait::proto::{plan_rel, rel::RelType};
    let root = plan.relations.first()?;
    let mut rel = match root.rel_type.as_ref()? {
        plan_rel::RelType::Root(r) => r.input.as_ref()?,
        plan_rel::RelType::Rel(r) => r,
    };
    loop {
        let next = match rel.rel_type.as_ref()? {
            RelType::Read(r) => {
                let sel = r.projection.as_ref()?.select.as_ref()?;
                return Some(
                    sel.struct_items
                        .iter()
                        .map(|i| i.field.max(0) as usize)
                        .collect(),
                );
            }
            RelType::Filter(f) => f.input.as_deref(),
            RelType::Project(p) => p.input.as_deref(),
            RelType::Aggregate(a) => a.input.as_deref(),
            RelType::Sort(s) => s.input.as_deref(),
            RelType::Fetch(f) => f.input.as_deref(),
            _ => None,
        };
        rel = next?;
    }
}

/// Refuses volatile expressions (the node must compute exactly what the compute
/// tier would) and checks the plan's shape for partial aggregation.
fn check_logical(plan: &LogicalPlan, mode: Mode) -> Result<()> {
    use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
    let mut bad = None;
    let _ = plan.apply(|p| {
        for e in p.expressions() {
            if e.is_volatile() {
                bad = Some(format!("volatile expression {e} cannot be pushed down"));
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        Ok(TreeNodeRecursion::Continue)
    });
    if let Some(b) = bad {
        return Err(Error::InvalidArgument(b));
    }
    if mode == Mode::PartialAggregate {
        let mut p = plan;
        while let LogicalPlan::Projection(pr) = p {
            p = pr.input.as_ref();
        }
        if !matches!(p, LogicalPlan::Aggregate(_)) {
            return Err(Error::InvalidArgument(
                "PARTIAL_AGGREGATE needs an aggregate at the root of the plan".into(),
            ));
        }
    }
    Ok(())
}

/// The input of the topmost final aggregate: partial states, one row per group and
/// partition.
fn partial_of(plan: Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    let mut p = plan;
    loop {
        if let Some(a) = p.downcast_ref::<AggregateExec>() {
            match a.mode() {
                AggregateMode::Final | AggregateMode::FinalPartitioned => {
                    return Ok(a.input().clone());
                }
                m => {
                    return Err(Error::Internal(format!(
                        "expected a final aggregate at the top of the plan, found {m:?}"
                    )));
                }
            }
        }
        let children = p.children();
        match children.as_slice() {
            [c] => {
                let c = (*c).clone();
                p = c;
            }
            _ => {
                return Err(Error::Internal(
                    "no final aggregate found in the partial-aggregate plan".into(),
                ));
            }
        }
    }
}

/// Rows the Parquet scans decoded after pruning (returned + dropped by filters
/// evaluated while decoding).
fn rows_scanned(plan: &Arc<dyn ExecutionPlan>) -> u64 {
    let mut n = 0u64;
    if plan.name() == "DataSourceExec"
        && let Some(m) = plan.metrics()
    {
        n += m.output_rows().unwrap_or(0) as u64;
        n += m
            .sum_by_name("pushdown_rows_pruned")
            .map(|v| v.as_usize() as u64)
            .unwrap_or(0);
    }
    for c in plan.children() {
        n += rows_scanned(c);
    }
    n
}

/// One table (or partition) of this node, as DataFusion sees it.
#[derive(Debug)]
struct NodeTable {
    schema: SchemaRef,
    objects: HashMap<String, ParquetObject>,
    store: NodeObjects,
    bytes_read: Arc<AtomicU64>,
}

#[async_trait]
impl TableProvider for NodeTable {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }
    fn table_type(&self) -> TableType {
        TableType::Base
    }
    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> datafusion::common::Result<Vec<TableProviderFilterPushDown>> {
        Ok(scan::exact(filters))
    }
    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> datafusion::common::Result<Arc<dyn ExecutionPlan>> {
        let mut files: Vec<(String, u64, u64)> = self
            .objects
            .values()
            .map(|o| (o.object.name.clone(), o.object.len, o.rows()))
            .collect();
        files.sort();
        let reader = Arc::new(NodeReaderFactory {
            objects: self.objects.clone(),
            store: self.store.clone(),
            bytes_read: self.bytes_read.clone(),
        });
        scan::parquet_scan(
            state,
            &ObjectStoreUrl::parse(NODE_URL)?,
            &self.schema,
            files,
            projection,
            filters,
            limit,
            Some(reader),
        )
    }
}

/// Hands DataFusion readers over the node's objects, with footers from the catalog.
#[derive(Debug)]
struct NodeReaderFactory {
    objects: HashMap<String, ParquetObject>,
    store: NodeObjects,
    bytes_read: Arc<AtomicU64>,
}

impl ParquetFileReaderFactory for NodeReaderFactory {
    fn create_reader(
        &self,
        _partition_index: usize,
        file: PartitionedFile,
        _metadata_size_hint: Option<usize>,
        _metrics: &ExecutionPlanMetricsSet,
    ) -> datafusion::common::Result<Box<dyn AsyncFileReader + Send>> {
        let name = file.object_meta.location.as_ref();
        let o = self.objects.get(name).ok_or_else(|| {
            datafusion::common::DataFusionError::Internal(format!("object {name} vanished"))
        })?;
        Ok(Box::new(
            ObjectReader::new(self.store.clone(), o.object.clone())
                .with_metadata(o.metadata.metadata().clone())
                .with_counter(self.bytes_read.clone()),
        ))
    }
}
