//! The node side of SQL pushdown: the `"sql"` operator. It decodes and checks a
//! [`SqlFragment`], plans it ([`crate::eval`]) over the node's own Parquet objects
//! (footers and page indexes come from the node's in-memory catalog, reads go
//! straight to the object store and are counted), and streams the result on the
//! node's CPU pool under its memory pool.

mod memory;
mod wasm;
use memory::LedgerPool;
pub use wasm::WasmOperator;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use bytes::Bytes;
use csd_runtime::admission::PushBack;
use csd_runtime::config::ByteSize;
use csd_runtime::memory::MemoryLedger;
use csd_runtime::operator::{Estimate, Operator, OperatorContext, OperatorStream};
use csd_runtime::store::ObjectStore as NodeObjects;
use csd_runtime::table::{ObjectReader, ParquetObject};
use csd_runtime::{Error, Result};
use datafusion::catalog::Session;
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::parquet::ParquetFileReaderFactory;
use datafusion::datasource::{TableProvider, TableType};
use datafusion::execution::memory_pool::{MemoryPool, TrackConsumersPool};
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown};
use datafusion::parquet::arrow::ProjectionMask;
use datafusion::parquet::arrow::async_reader::AsyncFileReader;
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    ExecutionPlan, ExecutionPlanProperties, SendableRecordBatchStream,
};
use datafusion_substrait::substrait::proto::Plan;
use futures::StreamExt;

use serde::Deserialize;

use crate::error::to_runtime;
use crate::eval::keyfilter::filter_stream;
use crate::eval::wasm::CancelOnDrop;
use crate::eval::wasm_fn::register_functions;
use crate::eval::{Parallelism, fragment_session, key_filtered, plan_fragment, scan};
use crate::wire::fragment::{OPERATOR_NAME, SqlFragment};
use crate::wire::functions::node_evaluates;
use crate::wire::keyfilter::{self, KeyFilter};

/// Object-store URL the node's scans use (reads go through [`NodeReaderFactory`]).
const NODE_URL: &str = "csd-node://local";

/// The `"sql"` operator's settings at a node: `[operators.sql]` in its settings
/// file, or `csd serve --set sql.KEY=VALUE`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SqlNodeOptions {
    /// Streams one fragment's scan is split into (see [`Parallelism`]).
    pub streams: usize,
    /// Objects smaller than this are not split.
    pub split_min_bytes: ByteSize,
    /// Rows of a direct scan's first batches its join-key filters are judged on
    /// before the node decides to run it or hand it back.
    pub judge_rows: usize,
    /// Functions this node will not run (e.g. `["regexp_like"]` on a drive with weak
    /// cores): a fragment calling one is refused as `UNIMPLEMENTED`, and the compute
    /// tier evaluates it itself, as it does a fragment handed back.
    pub refuse_functions: Vec<String>,
}

impl Default for SqlNodeOptions {
    fn default() -> Self {
        SqlNodeOptions {
            streams: Parallelism::NODE.streams,
            split_min_bytes: ByteSize(Parallelism::NODE.split_min_bytes),
            judge_rows: 8192,
            refuse_functions: Vec::new(),
        }
    }
}

/// The `"sql"` operator.
#[derive(Default)]
pub struct SqlOperator {
    memory: OnceLock<Arc<dyn MemoryPool>>,
    options: SqlNodeOptions,
}

impl SqlOperator {
    /// A new operator with the default settings (its memory pool draws on the node's
    /// memory ledger from first use).
    pub fn new() -> Self {
        Self::default()
    }

    /// This operator with `options`.
    pub fn with_options(self, options: SqlNodeOptions) -> Self {
        SqlOperator { options, ..self }
    }

    /// This operator with fragments split into `parallel` streams.
    pub fn with_parallelism(self, parallel: Parallelism) -> Self {
        let options = SqlNodeOptions {
            streams: parallel.streams,
            split_min_bytes: ByteSize(parallel.split_min_bytes),
            ..self.options.clone()
        };
        self.with_options(options)
    }

    /// Whether this node runs the Substrait function `name`: one the node evaluates
    /// exactly ([`node_evaluates`]) that its settings do not refuse.
    fn runs(&self, name: &str) -> bool {
        node_evaluates(name)
            && !self
                .options
                .refuse_functions
                .iter()
                .any(|r| r.eq_ignore_ascii_case(name))
    }

    fn parallel(&self) -> Parallelism {
        Parallelism {
            streams: self.options.streams.max(1),
            split_min_bytes: self.options.split_min_bytes.bytes(),
        }
    }

    fn pool(&self, ledger: &Arc<MemoryLedger>) -> Arc<dyn MemoryPool> {
        self.memory
            .get_or_init(|| {
                Arc::new(TrackConsumersPool::new(
                    LedgerPool::new(ledger.clone()),
                    std::num::NonZeroUsize::new(3).unwrap_or(std::num::NonZeroUsize::MIN),
                ))
            })
            .clone()
    }
}

/// The objects of `table` (or of its `partition`) at this node.
fn objects_in(
    ctx: &OperatorContext,
    table: &str,
    partition: Option<&str>,
) -> Result<(SchemaRef, Vec<ParquetObject>)> {
    let t = ctx.node.tables.table(table)?;
    let objects: Vec<ParquetObject> = match partition {
        Some(p) => t
            .partitions
            .get(p)
            .cloned()
            .ok_or_else(|| Error::NotFound(format!("partition {p} of table {table}")))?,
        None => t.partitions.values().flatten().cloned().collect(),
    };
    Ok((t.schema.clone(), objects))
}

/// The objects of `frag`'s table (or partition) at this node.
fn objects_of(
    ctx: &OperatorContext,
    frag: &SqlFragment,
) -> Result<(SchemaRef, Vec<ParquetObject>)> {
    let (schema, objects) = objects_in(ctx, &frag.table, frag.partition.as_deref())?;
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
    Ok((schema, objects))
}

/// A fragment's cost shape (see [`Operator::estimate`] for `SqlOperator`).
fn shape_of(frag: &SqlFragment) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    frag.table.hash(&mut h);
    frag.plan.hash(&mut h);
    frag.mode.hash(&mut h);
    frag.key_filters.is_empty().hash(&mut h);
    frag.direct_above.map(f32::to_bits).hash(&mut h);
    h.finish()
}

#[async_trait]
impl Operator for SqlOperator {
    fn name(&self) -> &'static str {
        OPERATOR_NAME
    }

    fn tables(&self, args: &Bytes) -> Result<Vec<String>> {
        let (frag, _mode, _plan) = SqlFragment::decode_checked(args)?;
        Ok(vec![frag.table])
    }

    /// A fragment that calls Wasm SQL functions runs the tenant's code.
    fn ships_code(&self, args: &Bytes) -> bool {
        SqlFragment::decode_checked(args).is_ok_and(|(f, _, _)| !f.functions.is_empty())
    }

    /// Fragments with Wasm SQL functions learn their cost apart, by their modules.
    fn cost_key(&self, args: &Bytes) -> Option<String> {
        let (frag, _, _) = SqlFragment::decode_checked(args).ok()?;
        let digests = crate::wire::wasm::check_functions(&frag.functions).ok()?;
        let first = digests.first()?;
        Some(format!("sql+wasm:{}", first.short()))
    }

    /// Bytes: the compressed column chunks of the columns the fragment reads, in
    /// every row group (pruning is left to the learned per-byte cost, which absorbs
    /// its average effect). Memory: four times the largest row group's share (the
    /// chunks, decompressed pages, decoded batches) for each stream, plus 16 MiB for
    /// batches and aggregation state. Shape: the plan and what is asked of it, not
    /// which partition nor which join keys (the same query's fragment over each
    /// partition, and run again, is one shape).
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
            memory: 4 * largest * self.parallel().streams as u64 + (16 << 20),
            shape: Some(shape_of(&frag)),
        })
    }

    async fn open(&self, ctx: OperatorContext, args: Bytes) -> Result<OperatorStream> {
        let (frag, mode, plan) = SqlFragment::decode_checked(&args)?;
        let (schema, objects) = objects_of(&ctx, &frag)?;
        let runtime = RuntimeEnvBuilder::new()
            .with_memory_pool(self.pool(&ctx.node.memory))
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
        let session = fragment_session(runtime, &frag.table, Arc::new(provider), self.parallel())?;
        let cancel = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let shipped =
            register_functions(&session, &ctx.node.sandbox, &frag.functions, &cancel).await?;
        let on_drop = CancelOnDrop(cancel);
        let runs = |f: &str| self.runs(f) || shipped.iter().any(|s| s == f);
        let physical = plan_fragment(&session, &frag.table, &plan, mode, &runs).await?;
        let schema: SchemaRef = physical.schema();
        let (physical, filters) = key_filtered(&frag, physical)?;
        ctx.metrics.set_detail("streams", scan_streams(&physical));
        let unfiltered = physical
            .execute(0, session.task_ctx())
            .map_err(to_runtime)?;
        let stream = match frag.direct_above.filter(|_| !filters.is_empty()) {
            Some(most) => judged(unfiltered, filters, most, self.options.judge_rows).await?,
            None => filter_stream(unfiltered, filters),
        };
        let metrics = ctx.metrics.clone();
        let done = futures::stream::once(async move {
            let _cancel = on_drop;
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

/// `stream` filtered, or handed back when the filters keep more than `most` of the
/// fragment's first `judge_rows` rows: for a scan that reduces nothing else,
/// reading the Parquet directly then moves fewer bytes than the survivors as Arrow
/// IPC.
async fn judged(
    mut stream: SendableRecordBatchStream,
    filters: Vec<KeyFilter>,
    most: f32,
    judge_rows: usize,
) -> Result<SendableRecordBatchStream> {
    let schema = stream.schema();
    let (mut seen, mut kept, mut head) = (0usize, 0usize, Vec::new());
    while seen < judge_rows {
        let Some(b) = stream.next().await else { break };
        let b = b.map_err(to_runtime)?;
        seen += b.num_rows();
        kept += keyfilter::mask_all(&filters, &b)
            .map_err(Error::Internal)?
            .true_count();
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
            bytes: 0,
        }));
    }
    let all = RecordBatchStreamAdapter::new(schema, futures::stream::iter(head).chain(stream));
    Ok(filter_stream(Box::pin(all), filters))
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

/// Streams the Parquet scans of `plan` run in (the most of any scan).
fn scan_streams(plan: &Arc<dyn ExecutionPlan>) -> usize {
    let own = if plan.name() == "DataSourceExec" {
        plan.output_partitioning().partition_count()
    } else {
        0
    };
    plan.children()
        .into_iter()
        .map(scan_streams)
        .fold(own, usize::max)
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
