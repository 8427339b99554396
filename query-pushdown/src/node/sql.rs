//! One SQL fragment, parsed once ([`SqlRequest`]): the tables it reads, whether it
//! runs shipped code, its cost key and shape, its estimate from the catalog, and
//! finally its plan over the node's own Parquet objects, run on the CPU pool under
//! the node's memory pool.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use csd_protocol::{Error, ModuleDigest, PushBack, PushBackCause, Result};
use csd_runtime::attachments::Attachments;
use csd_runtime::operator::{CostKey, Estimate, OperatorContext, OperatorRequest, OperatorStream};
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::parquet::arrow::ProjectionMask;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    ExecutionPlan, ExecutionPlanProperties, SendableRecordBatchStream,
};
use datafusion_substrait::substrait::proto::Plan;
use futures::StreamExt;

use super::guard::guarded;
use super::operator::{SqlOperator, objects_of};
use super::table::{NODE_URL, NodeTable, as_planned, with_views};
use crate::error::to_runtime;
use crate::eval::keyfilter::filter_stream;
use crate::eval::wasm::CancelOnDrop;
use crate::eval::wasm_fn::register_functions;
use crate::eval::{fragment_session, key_filtered, plan_fragment};
use crate::wire::details::SqlDetails;
use crate::wire::fragment::{CheckedFragment, Mode, SqlFragment};
use crate::wire::keyfilter::{self, KeyFilter};

/// A `"sql"` request, decoded and checked once.
pub(crate) struct SqlRequest {
    op: Arc<SqlOperator>,
    frag: SqlFragment,
    mode: Mode,
    plan: Plan,
    /// The modules of its Wasm SQL functions, checked with the fragment.
    digests: Vec<ModuleDigest>,
}

impl SqlRequest {
    /// `args` of `op`, decoded and checked.
    pub(super) fn parse(op: Arc<SqlOperator>, args: &[u8]) -> Result<Self> {
        Ok(Self::of(op, SqlFragment::decode_checked(args)?))
    }

    /// A fragment decoded and checked already (a `"wasm"` request's input).
    pub(super) fn of(op: Arc<SqlOperator>, checked: CheckedFragment) -> Self {
        let CheckedFragment {
            frag,
            mode,
            plan,
            digests,
        } = checked;
        SqlRequest {
            op,
            frag,
            mode,
            plan,
            digests,
        }
    }

    /// The fragment.
    pub(super) fn fragment(&self) -> &SqlFragment {
        &self.frag
    }
}

#[async_trait]
impl OperatorRequest for SqlRequest {
    fn tables(&self) -> Vec<String> {
        vec![self.frag.table.clone()]
    }

    /// A fragment that calls Wasm SQL functions runs the tenant's code.
    fn ships_code(&self) -> bool {
        !self.frag.functions.is_empty()
    }

    /// Fragments with Wasm SQL functions learn their cost apart, by their first
    /// module.
    fn cost_key(&self) -> Option<CostKey> {
        self.digests.first().map(|first| CostKey::Module {
            operator: crate::wire::fragment::OPERATOR_NAME.to_string(),
            module: *first,
        })
    }

    /// Bytes: the compressed column chunks of the columns the fragment reads, in
    /// every row group (pruning is left to the learned per-byte cost, which absorbs
    /// its average effect). Memory: four times the largest row group's share (the
    /// chunks, decompressed pages, decoded batches) for each stream, plus 16 MiB for
    /// batches and aggregation state, plus the state the asker expects the plan to
    /// hold (a part run whole: [`SqlFragment::state_bytes`]). Shape: the plan and
    /// what is asked of it, not which partition nor which join keys (the same query's fragment over each
    /// partition, and run again, is one shape).
    async fn estimate(&self, ctx: &OperatorContext) -> Result<Estimate> {
        let (_, objects) = objects_of(ctx, &self.frag)?;
        let columns = read_columns(&self.plan);
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
            // Saturating: `state_bytes` is the asker's word, and any size past the
            // budget is handed back.
            memory: (4 * largest * self.op.parallel().streams as u64 + (16 << 20))
                .saturating_add(self.frag.state_bytes.unwrap_or(0)),
            shape: Some(shape_of(&self.frag)),
        })
    }

    async fn open(self: Box<Self>, ctx: OperatorContext) -> Result<OperatorStream> {
        let SqlRequest {
            op,
            frag,
            mode,
            plan,
            digests,
        } = *self;
        let frag = with_attachments(frag, &ctx.node.attachments)?;
        let (schema, objects) = objects_of(&ctx, &frag)?;
        // Strings read as views when the asker said what types it planned, so the
        // answer can be cast back to them.
        let planned = frag.planned_schema()?;
        let schema = match planned {
            Some(_) => with_views(&schema).unwrap_or(schema),
            None => schema,
        };
        let runtime = RuntimeEnvBuilder::new()
            .with_memory_pool(op.pool(&ctx.node.memory))
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
        let session = fragment_session(
            runtime,
            &frag.table,
            Arc::new(provider),
            op.parallel(),
            frag.late_filters,
        )?;
        // A partial aggregate to judge while running: DataFusion's probe at its line.
        let shrink_above = frag.shrink_above.filter(|_| mode == Mode::PartialAggregate);
        if let Some(f) = shrink_above {
            let state = session.state_ref();
            let mut state = state.write();
            let execution = &mut state.config_mut().options_mut().execution;
            execution.skip_partial_aggregation_probe_ratio_threshold = f64::from(f);
            execution.skip_partial_aggregation_probe_rows_threshold =
                op.options.shrink_probe_rows.max(1);
        }
        let cancel = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let shipped = register_functions(
            &session,
            &ctx.node.sandbox,
            &frag.functions,
            &digests,
            &cancel,
        )
        .await?;
        let on_drop = CancelOnDrop(cancel);
        let runs = |f: &str| op.runs(f) || shipped.iter().any(|s| s == f);
        let physical = plan_fragment(&session, &frag.table, &plan, mode, &runs).await?;
        let schema: SchemaRef = physical.schema();
        let (physical, filters) = key_filtered(&frag, physical)?;
        let physical = match shrink_above {
            Some(f) => guarded(physical, f).map_err(to_runtime)?,
            None => physical,
        };
        ctx.metrics.set_details(&SqlDetails {
            streams: scan_streams(&physical),
        });
        let unfiltered = physical
            .execute(0, session.task_ctx())
            .map_err(to_runtime)?;
        let stream = match frag.direct_above.filter(|_| !filters.is_empty()) {
            Some(most) => judged(unfiltered, filters, most, op.options.judge_rows).await?,
            None => filter_stream(unfiltered, filters),
        };
        let conformed = planned.as_ref().and_then(|p| as_planned(&schema, p));
        let (schema, stream) = match conformed {
            Some((planned, cast)) => {
                let cast: SendableRecordBatchStream = Box::pin(RecordBatchStreamAdapter::new(
                    planned.clone(),
                    stream.map(move |b| b.and_then(&cast)),
                ));
                (planned, cast)
            }
            None => (schema, stream),
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
}

/// `frag` with the blocks of each key filter it names by attachment in place: an
/// attachment the node no longer keeps is `NOT_FOUND` naming it, for the asker to
/// send again.
fn with_attachments(mut frag: SqlFragment, attachments: &Attachments) -> Result<SqlFragment> {
    for k in &mut frag.key_filters {
        if let Some(d) = k.attached()? {
            k.blocks = attachments.get(&d)?.to_vec();
            k.attachment = None;
        }
    }
    Ok(frag)
}

/// A fragment's cost shape (see [`SqlRequest::estimate`](OperatorRequest::estimate)).
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
        kept += keyfilter::mask_all(&filters, &b)?.true_count();
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
            cause: PushBackCause::Judgement,
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
