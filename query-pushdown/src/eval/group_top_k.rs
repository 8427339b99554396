//! A per-group top-k found in one pass over the rows, before the sort a ranking
//! window needs.
//!
//! `WHERE rn <= k` over `row_number()` or `rank() OVER (PARTITION BY p ORDER BY o)`
//! keeps at most `k` rows of each group (all ties at the k-th place, for `rank`).
//! DataFusion plans it as a sort of every row on `(p, o)`, the window, then the
//! filter: an O(n log n) sort of every row for a few rows a group. [`GroupTopKExec`]
//! goes under that sort and passes on, of the rows it reads, only those that are
//! among the first `k` of their group by `o` (ties at the k-th place included): a row
//! with `k` rows of its group strictly before it is never ranked within `k`, in this
//! stream or in all of them, so the sort, window and filter above give the same
//! answer over far fewer rows. It needs no distribution of its input: each stream
//! keeps its own groups' first rows.
//!
//! Groups are numbered by DataFusion's own hash-aggregation tables; per group it
//! holds the order keys of its current first rows (arrow's row format, compared as
//! bytes) and the first 16 bytes of the k-th, which turn most rows away without
//! touching anything else, and the kept rows themselves, compacted as they are
//! overtaken. When
//! it would not shrink its input (nearly a group per row, or more than half the rows
//! kept after its first million) or its memory reservation is refused, it passes
//! what it holds and then every row on unchanged: the sort above still gives the
//! answer, as without it. [`GroupTopK`] is the physical rule that places it.

use std::fmt;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch, UInt32Array};
use arrow::compute::{interleave_record_batch, take_record_batch};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::row::{RowConverter, SortField};
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{DataFusionError, Result, ScalarValue};
use datafusion::execution::TaskContext;
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::{BinaryExpr, Column, Literal};
use datafusion::physical_expr::window::{StandardWindowExpr, WindowExpr};
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr, PhysicalSortExpr};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::group_values::{GroupValues, new_group_values};
use datafusion::physical_plan::aggregates::order::GroupOrdering;
use datafusion::physical_plan::execution_plan::{
    ChildrenPropertiesMode, ReplaceChildrenOptions, replace_children_if_necessary,
};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::metrics::{BaselineMetrics, ExecutionPlanMetricsSet, MetricsSet};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::windows::{BoundedWindowAggExec, WindowAggExec, WindowUDFExpr};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
    SendableRecordBatchStream, apply_expression_roots,
};
use futures::StreamExt;

/// Rows read before the kept share is judged.
const JUDGE_AFTER: usize = 1 << 20;
/// Rows read before a group per row is judged (distinct keys show early).
const JUDGE_GROUPS_AFTER: usize = 1 << 17;
/// Rows held beyond twice the kept ones before they are compacted.
const COMPACT_SLACK: usize = 1 << 16;
/// Rows per batch passed on.
const BATCH_ROWS: usize = 8192;

/// Physical rule: a [`GroupTopKExec`] under the sort of every ranking window whose
/// rank a filter above bounds.
#[derive(Debug, Default)]
pub(crate) struct GroupTopK;

impl PhysicalOptimizerRule for GroupTopK {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_down(|p| {
            Ok(match place(&p)? {
                Some(placed) => Transformed::yes(placed),
                None => Transformed::no(p),
            })
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "GroupTopK"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// `plan` with a [`GroupTopKExec`] placed under its window's sort, when `plan` is a
/// filter bounding a ranking window's rank.
fn place(plan: &Arc<dyn ExecutionPlan>) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let Some(filter) = plan.downcast_ref::<FilterExec>() else {
        return Ok(None);
    };
    let Some((column, k)) = bound(filter.predicate()) else {
        return Ok(None);
    };
    // Down to the window, through projections that pass the rank column on.
    let mut above = vec![plan.clone()];
    let mut node = filter.input().clone();
    let mut column = column;
    let (window_input, expr) = loop {
        if let Some(p) = node.downcast_ref::<ProjectionExec>() {
            let Some(c) = p
                .expr()
                .get(column)
                .and_then(|e| e.expr.downcast_ref::<Column>())
            else {
                return Ok(None);
            };
            column = c.index();
        } else if let Some((input, exprs)) = window(&node) {
            break (input.clone(), window_expr(exprs, input, column));
        } else {
            return Ok(None);
        }
        above.push(node.clone());
        node = node.children()[0].clone();
    };
    let Some(expr) = expr else {
        return Ok(None);
    };
    // The window's own sort, then any repartitioning under it: the rows' order
    // below does not matter to either.
    let mut under = vec![node, window_input];
    match under[1].downcast_ref::<SortExec>() {
        Some(s) if s.fetch().is_none() => {}
        _ => return Ok(None),
    }
    loop {
        let child = under[under.len() - 1].children()[0].clone();
        match child.downcast_ref::<RepartitionExec>() {
            Some(r) if !r.preserve_order() => under.push(child),
            _ => {
                if child.downcast_ref::<GroupTopKExec>().is_some() {
                    return Ok(None);
                }
                under.push(child);
                break;
            }
        }
    }
    let rows = under.pop().expect("the sort's input");
    let mut rebuilt: Arc<dyn ExecutionPlan> = Arc::new(GroupTopKExec::new(
        rows,
        expr.partition_by().to_vec(),
        expr.order_by().to_vec(),
        k,
    ));
    for p in under.into_iter().rev().chain(above.into_iter().rev()) {
        rebuilt = replace_children_if_necessary(p, vec![rebuilt])?;
    }
    Ok(Some(rebuilt))
}

/// A window operator's input and its window expressions.
type Window<'a> = (&'a Arc<dyn ExecutionPlan>, &'a [Arc<dyn WindowExpr>]);

/// A window operator's input and expressions.
fn window(plan: &Arc<dyn ExecutionPlan>) -> Option<Window<'_>> {
    if let Some(w) = plan.downcast_ref::<BoundedWindowAggExec>() {
        return Some((w.input(), w.window_expr()));
    }
    let w = plan.downcast_ref::<WindowAggExec>()?;
    Some((w.input(), w.window_expr()))
}

/// The window expression producing output `column`, if it is `row_number` or `rank`
/// with a PARTITION BY.
fn window_expr(
    exprs: &[Arc<dyn WindowExpr>],
    input: &Arc<dyn ExecutionPlan>,
    column: usize,
) -> Option<Arc<dyn WindowExpr>> {
    let expr = exprs.get(column.checked_sub(input.schema().fields().len())?)?;
    let f = expr
        .as_any()
        .downcast_ref::<StandardWindowExpr>()?
        .get_standard_func_expr()
        .as_any()
        .downcast_ref::<WindowUDFExpr>()?;
    (matches!(f.fun().name(), "row_number" | "rank") && !expr.partition_by().is_empty())
        .then(|| expr.clone())
}

/// `column <= k`, `column < k + 1` or `column = k` (either way round), as the
/// column's index and `k` (at least 1).
fn bound(predicate: &Arc<dyn PhysicalExpr>) -> Option<(usize, usize)> {
    let b = predicate.downcast_ref::<BinaryExpr>()?;
    if *b.op() == Operator::And {
        return bound(b.left()).or_else(|| bound(b.right()));
    }
    let (column, op, value) = match (
        b.left().downcast_ref::<Column>(),
        b.right().downcast_ref::<Literal>(),
    ) {
        (Some(c), Some(l)) => (c, *b.op(), l.value()),
        _ => (
            b.right().downcast_ref::<Column>()?,
            b.op().swap()?,
            b.left().downcast_ref::<Literal>()?.value(),
        ),
    };
    let n = match value.cast_to(&DataType::UInt64).ok()? {
        ScalarValue::UInt64(Some(n)) => usize::try_from(n).ok()?,
        _ => return None,
    };
    let k = match op {
        Operator::LtEq | Operator::Eq => n,
        Operator::Lt => n.checked_sub(1)?,
        _ => return None,
    };
    (k >= 1).then_some((column.index(), k))
}

/// Passes on, of its input's rows, those among the first `k` of their group (module
/// docs).
#[derive(Debug)]
pub(crate) struct GroupTopKExec {
    input: Arc<dyn ExecutionPlan>,
    partition_by: Vec<Arc<dyn PhysicalExpr>>,
    order_by: Vec<PhysicalSortExpr>,
    k: usize,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl GroupTopKExec {
    fn new(
        input: Arc<dyn ExecutionPlan>,
        partition_by: Vec<Arc<dyn PhysicalExpr>>,
        order_by: Vec<PhysicalSortExpr>,
        k: usize,
    ) -> Self {
        let properties = PlanProperties::new(
            EquivalenceProperties::new(input.schema()),
            input.output_partitioning().clone(),
            input.pipeline_behavior(),
            input.boundedness(),
        );
        GroupTopKExec {
            input,
            partition_by,
            order_by,
            k,
            properties: Arc::new(properties),
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }
}

impl DisplayAs for GroupTopKExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let by: Vec<String> = self.partition_by.iter().map(|e| e.to_string()).collect();
        let order: Vec<String> = self.order_by.iter().map(|e| e.to_string()).collect();
        write!(
            f,
            "GroupTopKExec: k={}, partition_by=[{}], order_by=[{}]",
            self.k,
            by.join(", "),
            order.join(", ")
        )
    }
}

impl ExecutionPlan for GroupTopKExec {
    fn name(&self) -> &str {
        "GroupTopKExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![false]
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        apply_expression_roots(
            self.partition_by
                .iter()
                .chain(self.order_by.iter().map(|s| &s.expr)),
            f,
        )
    }

    fn replace_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
        _: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let [input] = &children[..] else {
            return Err(DataFusionError::Internal(
                "GroupTopKExec takes one input".into(),
            ));
        };
        Ok(Arc::new(GroupTopKExec::new(
            input.clone(),
            self.partition_by.clone(),
            self.order_by.clone(),
            self.k,
        )))
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

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let input = self.input.execute(partition, context.clone())?;
        let schema = input.schema();
        let top = Top::new(self, &schema)?;
        let reservation = MemoryConsumer::new(format!("GroupTopKExec[{partition}]"))
            .register(context.memory_pool());
        let state = State {
            input,
            top: Some(top),
            reservation,
            out: Vec::new(),
            ended: false,
            metrics: BaselineMetrics::new(&self.metrics, partition),
        };
        let stream = futures::stream::unfold(state, |mut s| async move {
            let next = s.next().await;
            next.map(|b| (b, s))
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, stream)))
    }
}

/// One stream's progress: reading and keeping (`top` is some), then passing on.
struct State {
    input: SendableRecordBatchStream,
    top: Option<Top>,
    reservation: MemoryReservation,
    /// Batches ready to pass on, last first.
    out: Vec<RecordBatch>,
    /// The input has ended (it is not polled again).
    ended: bool,
    metrics: BaselineMetrics,
}

impl State {
    async fn next(&mut self) -> Option<Result<RecordBatch>> {
        loop {
            if let Some(b) = self.out.pop() {
                self.metrics.record_output(b.num_rows());
                return Some(Ok(b));
            }
            if self.ended {
                return None;
            }
            let item = self.input.next().await;
            self.ended = item.is_none();
            let Some(top) = self.top.as_mut() else {
                if let Some(Ok(b)) = &item {
                    self.metrics.record_output(b.num_rows());
                }
                return item;
            };
            let timer = self.metrics.elapsed_compute().timer();
            let done = match item {
                Some(Ok(batch)) => match top.push(&batch) {
                    Err(e) => return Some(Err(e)),
                    Ok(()) => top.gives_up() || self.reservation.try_resize(top.size()).is_err(),
                },
                Some(Err(e)) => return Some(Err(e)),
                None => true,
            };
            if done {
                let top = self.top.take().expect("still keeping");
                match top.finish() {
                    Ok(mut batches) => {
                        batches.reverse();
                        self.out = batches;
                    }
                    Err(e) => return Some(Err(e)),
                }
                self.reservation.free();
            }
            timer.done();
        }
    }
}

/// A kept row: its order key (and the key's [`prefix`], compared first) and where
/// it is held.
struct Entry {
    prefix: u128,
    key: Box<[u8]>,
    batch: u32,
    row: u32,
}

/// A key's first 16 bytes, big-endian, zero-padded: when two keys' prefixes
/// differ, they order as the keys do.
fn prefix(key: &[u8]) -> u128 {
    let mut b = [0u8; 16];
    let n = key.len().min(16);
    b[..n].copy_from_slice(&key[..n]);
    u128::from_be_bytes(b)
}

/// The first `k` rows (and ties) of every group seen so far.
struct Top {
    k: usize,
    partition_by: Vec<Arc<dyn PhysicalExpr>>,
    order_by: Vec<Arc<dyn PhysicalExpr>>,
    /// Group ids by the partition keys (DataFusion's hash aggregation's own).
    groups: Box<dyn GroupValues>,
    ids: Vec<usize>,
    order_rows: RowConverter,
    /// Per group, the prefix of its k-th kept key (`u128::MAX` while it keeps
    /// fewer): most rows are turned away on it alone.
    worst: Vec<u128>,
    /// Per group, its kept rows, first first.
    kept_of: Vec<Vec<Entry>>,
    /// The rows held: kept ones and overtaken ones not yet compacted away.
    held: Vec<RecordBatch>,
    held_rows: usize,
    held_bytes: usize,
    kept: usize,
    seen: usize,
    /// Bytes of the order keys held.
    key_bytes: usize,
}

impl Top {
    fn new(exec: &GroupTopKExec, schema: &SchemaRef) -> Result<Self> {
        let groups = exec
            .partition_by
            .iter()
            .enumerate()
            .map(|(i, e)| {
                Ok(Field::new(
                    format!("g{i}"),
                    e.data_type(schema)?,
                    e.nullable(schema)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let order = exec
            .order_by
            .iter()
            .map(|s| {
                Ok(SortField::new_with_options(
                    s.expr.data_type(schema)?,
                    s.options,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Top {
            k: exec.k,
            partition_by: exec.partition_by.clone(),
            order_by: exec.order_by.iter().map(|s| s.expr.clone()).collect(),
            groups: new_group_values(Arc::new(Schema::new(groups)), &GroupOrdering::None)?,
            ids: Vec::new(),
            order_rows: RowConverter::new(order)?,
            worst: Vec::new(),
            kept_of: Vec::new(),
            held: Vec::new(),
            held_rows: 0,
            held_bytes: 0,
            kept: 0,
            seen: 0,
            key_bytes: 0,
        })
    }

    fn push(&mut self, batch: &RecordBatch) -> Result<()> {
        let n = batch.num_rows();
        if n == 0 {
            return Ok(());
        }
        self.seen += n;
        let eval = |exprs: &[Arc<dyn PhysicalExpr>]| -> Result<Vec<ArrayRef>> {
            exprs
                .iter()
                .map(|e| e.evaluate(batch)?.into_array(n))
                .collect()
        };
        self.groups
            .intern(&eval(&self.partition_by)?, &mut self.ids)?;
        let groups = self.groups.len();
        self.worst.resize(groups, u128::MAX);
        self.kept_of.resize_with(groups, Vec::new);
        let order = self.order_rows.convert_columns(&eval(&self.order_by)?)?;
        let at = u32::try_from(self.held.len())
            .map_err(|_| DataFusionError::Internal("too many batches held".into()))?;
        let k = self.k;
        // First, every row against its group's k-th prefix alone: independent
        // loads, no branches, so the memory system overlaps them.
        let prefixes: Vec<u128> = (0..n).map(|i| prefix(order.row(i).as_ref())).collect();
        let worst = &self.worst;
        let may: Vec<bool> = self
            .ids
            .iter()
            .zip(&prefixes)
            .map(|(&g, &p)| p <= worst[g])
            .collect();
        let mut taken: Vec<u32> = Vec::new();
        for i in (0..n).filter(|&i| may[i]) {
            let g = self.ids[i];
            let (p, key) = (prefixes[i], order.row(i));
            let key = key.as_ref();
            let entries = &mut self.kept_of[g];
            let after = |e: &Entry| (e.prefix, &*e.key) > (p, key);
            let kth = entries.get(k - 1);
            if kth.is_some_and(|e| (e.prefix, &*e.key) < (p, key)) {
                continue;
            }
            let place = entries.partition_point(|e| !after(e));
            entries.insert(
                place,
                Entry {
                    prefix: p,
                    key: key.into(),
                    batch: at,
                    row: taken.len() as u32,
                },
            );
            taken.push(i as u32);
            self.kept += 1;
            self.key_bytes += key.len();
            if entries.len() >= k {
                let kth = (entries[k - 1].prefix, &*entries[k - 1].key);
                let cut = entries[k..]
                    .iter()
                    .position(|e| (e.prefix, &*e.key) > kth)
                    .map_or(entries.len(), |p| p + k);
                for e in &entries[cut..] {
                    self.key_bytes -= e.key.len();
                }
                self.kept -= entries.len() - cut;
                entries.truncate(cut);
                self.worst[g] = entries[k - 1].prefix;
            }
        }
        if !taken.is_empty() {
            self.held_rows += taken.len();
            let rows = own_views(take_record_batch(batch, &UInt32Array::from(taken))?)?;
            self.held_bytes += rows.get_array_memory_size();
            self.held.push(rows);
        }
        if self.held_rows > 2 * self.kept + COMPACT_SLACK {
            self.compact()?;
        }
        Ok(())
    }

    /// Whether keeping does not pay here: nearly a group per row, or most rows kept.
    fn gives_up(&self) -> bool {
        (self.seen >= JUDGE_GROUPS_AFTER && self.groups.len() * 10 >= self.seen * 9)
            || (self.seen >= JUDGE_AFTER && self.kept * 2 > self.seen)
    }

    /// Memory held: the rows, the keys, the groups.
    fn size(&self) -> usize {
        let entries = self.kept * std::mem::size_of::<Entry>();
        let groups = self.groups.size()
            + self.worst.capacity() * std::mem::size_of::<u128>()
            + self.kept_of.capacity() * std::mem::size_of::<Vec<Entry>>();
        self.held_bytes + entries + groups + self.key_bytes
    }

    /// The kept rows gathered into one batch, the entries pointing into it.
    fn compact(&mut self) -> Result<()> {
        let mut places = Vec::with_capacity(self.kept);
        for entries in self.kept_of.iter_mut() {
            for e in entries.iter_mut() {
                places.push((e.batch as usize, e.row as usize));
                e.batch = 0;
                e.row = (places.len() - 1) as u32;
            }
        }
        let held: Vec<&RecordBatch> = self.held.iter().collect();
        let batch = match held.first() {
            Some(first) if places.is_empty() => first.slice(0, 0),
            Some(_) => interleave_record_batch(&held, &places)?,
            None => return Ok(()),
        };
        let batch = own_views(batch)?;
        self.held_rows = batch.num_rows();
        self.held_bytes = batch.get_array_memory_size();
        self.held = vec![batch];
        Ok(())
    }

    /// The kept rows, in batches.
    fn finish(mut self) -> Result<Vec<RecordBatch>> {
        self.compact()?;
        let Some(all) = self.held.pop() else {
            return Ok(Vec::new());
        };
        Ok((0..all.num_rows())
            .step_by(BATCH_ROWS)
            .map(|at| all.slice(at, BATCH_ROWS.min(all.num_rows() - at)))
            .collect())
    }
}

/// `batch` with its string and binary views' buffers holding only its own values,
/// so rows kept from a batch do not hold the whole batch's bytes.
fn own_views(batch: RecordBatch) -> Result<RecordBatch> {
    if !batch
        .columns()
        .iter()
        .any(|c| matches!(c.data_type(), DataType::Utf8View | DataType::BinaryView))
    {
        return Ok(batch);
    }
    let columns = batch
        .columns()
        .iter()
        .map(|c| -> ArrayRef {
            match c.data_type() {
                DataType::Utf8View => Arc::new(c.as_string_view().gc()),
                DataType::BinaryView => Arc::new(c.as_binary_view().gc()),
                _ => c.clone(),
            }
        })
        .collect();
    Ok(RecordBatch::try_new(batch.schema(), columns)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringViewArray};
    use arrow::datatypes::{Field, Schema};
    use arrow::util::pretty::pretty_format_batches;
    use datafusion::datasource::MemTable;
    use datafusion::execution::SessionStateBuilder;
    use datafusion::physical_plan::{collect, displayable};
    use datafusion::prelude::{SessionConfig, SessionContext};
    use proptest::prelude::*;

    /// A session with the rule (or without) over `t(id, g, s, v)` in `parts`
    /// partitions of batches of `batch` rows.
    fn session(
        rule: bool,
        rows: &[(i64, Option<i64>, String, Option<i64>)],
        parts: usize,
        batch: usize,
    ) -> SessionContext {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("g", DataType::Int64, true),
            Field::new("s", DataType::Utf8View, false),
            Field::new("v", DataType::Int64, true),
        ]));
        let mut partitions = vec![Vec::new(); parts];
        for (i, chunk) in rows.chunks(batch.max(1)).enumerate() {
            let b = RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(Int64Array::from_iter_values(chunk.iter().map(|r| r.0))),
                    Arc::new(Int64Array::from_iter(chunk.iter().map(|r| r.1))),
                    Arc::new(StringViewArray::from_iter_values(
                        chunk.iter().map(|r| r.2.as_str()),
                    )),
                    Arc::new(Int64Array::from_iter(chunk.iter().map(|r| r.3))),
                ],
            )
            .unwrap();
            partitions[i % parts].push(b);
        }
        let mut builder = SessionStateBuilder::new()
            .with_default_features()
            .with_config(SessionConfig::new().with_target_partitions(2));
        if rule {
            builder = builder.with_physical_optimizer_rule(Arc::new(GroupTopK));
        }
        let ctx = SessionContext::new_with_state(builder.build());
        ctx.register_table(
            "t",
            Arc::new(MemTable::try_new(schema, partitions).unwrap()),
        )
        .unwrap();
        ctx
    }

    /// The query's rows, sorted, and whether its plan holds a `GroupTopKExec`.
    async fn run(ctx: &SessionContext, sql: &str) -> (String, bool) {
        let df = ctx.sql(sql).await.unwrap();
        let plan = df.create_physical_plan().await.unwrap();
        let placed = displayable(plan.as_ref())
            .indent(true)
            .to_string()
            .contains("GroupTopKExec");
        let batches = collect(plan, ctx.task_ctx()).await.unwrap();
        let mut lines: Vec<String> = pretty_format_batches(&batches)
            .unwrap()
            .to_string()
            .lines()
            .map(str::to_string)
            .collect();
        lines.sort();
        (lines.join("\n"), placed)
    }

    fn queries(k: usize) -> Vec<(String, bool)> {
        vec![
            // row_number over a total order: which rows is deterministic.
            (
                format!(
                    "SELECT id, g, v FROM (SELECT id, g, v, row_number() OVER (PARTITION BY g ORDER BY v DESC, id) AS rn FROM t) WHERE rn <= {k}"
                ),
                true,
            ),
            // rank with ties and NULLs in the order key.
            (
                format!(
                    "SELECT id, g, v, rn FROM (SELECT id, g, v, rank() OVER (PARTITION BY g ORDER BY v) AS rn FROM t) WHERE rn <= {k}"
                ),
                true,
            ),
            // a string group, `<`, the bound on the left.
            (
                format!(
                    "SELECT s, id FROM (SELECT s, id, row_number() OVER (PARTITION BY s ORDER BY id DESC) AS rn FROM t) WHERE {} > rn",
                    k + 1
                ),
                true,
            ),
            // two groups keys, `=`.
            (
                format!(
                    "SELECT g, s, id FROM (SELECT g, s, id, rank() OVER (PARTITION BY g, s ORDER BY v NULLS FIRST, id) AS rn FROM t) WHERE rn = {k}"
                ),
                true,
            ),
            // dense_rank is not a top-k by rows: left alone.
            (
                format!(
                    "SELECT id FROM (SELECT id, dense_rank() OVER (PARTITION BY g ORDER BY v) AS rn FROM t) WHERE rn <= {k}"
                ),
                false,
            ),
        ]
    }

    fn rows(n: usize, groups: i64, seed: u64) -> Vec<(i64, Option<i64>, String, Option<i64>)> {
        let mut x = seed | 1;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        (0..n as i64)
            .map(|id| {
                let g = next() % groups.max(1) as u64;
                let v = next() % 50;
                (
                    id,
                    (g % 11 != 3).then_some(g as i64),
                    format!("s{}", g % 7),
                    (v % 13 != 0).then_some(v as i64),
                )
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// Every ranking filter gives the same rows with the operator as without.
        #[test]
        fn the_same_rows_as_without(
            n in 0usize..3000,
            groups in 1i64..400,
            k in 1usize..4,
            parts in 1usize..4,
            batch in 1usize..700,
            seed in any::<u64>(),
        ) {
            let data = rows(n, groups, seed);
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            rt.block_on(async {
                let (with, without) = (session(true, &data, parts, batch), session(false, &data, parts, batch));
                for (sql, placed) in queries(k) {
                    let (a, p) = run(&with, &sql).await;
                    let (b, _) = run(&without, &sql).await;
                    assert_eq!(p, placed, "{sql}");
                    assert_eq!(a, b, "{sql}");
                }
            });
        }
    }

    /// Input in the worst order (each row overtakes its group's first rows) is
    /// compacted as it goes and gives the same rows; nearly a group a row passes
    /// everything on; a few groups keep a few rows.
    #[tokio::test]
    async fn compacts_gives_up_and_shrinks() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("g", DataType::Int64, false),
            Field::new("v", DataType::Int64, false),
        ]));
        let exec = |g: Vec<i64>, v: Vec<i64>| {
            let batches: Vec<RecordBatch> = g
                .chunks(4096)
                .zip(v.chunks(4096))
                .map(|(g, v)| {
                    RecordBatch::try_new(
                        schema.clone(),
                        vec![
                            Arc::new(Int64Array::from(g.to_vec())),
                            Arc::new(Int64Array::from(v.to_vec())),
                        ],
                    )
                    .unwrap()
                })
                .collect();
            let source = datafusion::datasource::memory::MemorySourceConfig::try_new_exec(
                &[batches],
                schema.clone(),
                None,
            )
            .unwrap();
            Arc::new(GroupTopKExec::new(
                source,
                vec![Arc::new(Column::new("g", 0))],
                vec![PhysicalSortExpr::new(
                    Arc::new(Column::new("v", 1)),
                    arrow::compute::SortOptions {
                        descending: true,
                        nulls_first: true,
                    },
                )],
                2,
            ))
        };
        let ctx = SessionContext::new();
        // 300,000 rows of 10 groups, v rising: every row enters, compaction keeps
        // memory to the 20 kept rows; the answer is the two largest v per group.
        let n = 300_000i64;
        let top = exec((0..n).map(|i| i % 10).collect(), (0..n).collect());
        let out = collect(top.clone(), ctx.task_ctx()).await.unwrap();
        let mut got: Vec<(i64, i64)> = out
            .iter()
            .flat_map(|b| {
                let g = b
                    .column(0)
                    .as_primitive::<arrow::datatypes::Int64Type>()
                    .clone();
                let v = b
                    .column(1)
                    .as_primitive::<arrow::datatypes::Int64Type>()
                    .clone();
                (0..b.num_rows()).map(move |i| (g.value(i), v.value(i)))
            })
            .collect();
        got.sort();
        let want: Vec<(i64, i64)> = (0..10)
            .flat_map(|g| [(g, n - 20 + g), (g, n - 10 + g)])
            .collect();
        assert_eq!(got, want);
        // A group per row: after the judged rows, everything is passed on.
        let unique = exec((0..n).collect(), (0..n).collect());
        let out = collect(unique, ctx.task_ctx()).await.unwrap();
        assert_eq!(out.iter().map(|b| b.num_rows()).sum::<usize>(), n as usize);
    }
}
