//! A query's part that reads one table, all of whose partitions live on one node,
//! runs whole at that node.
//!
//! Aggregates split in two phases because a table's rows are spread over nodes.
//! When one node holds every partition (its copies elsewhere are replicas), that
//! node can run the aggregates, the filters over them (HAVING) and the aggregates
//! over those to the end: its answer is the part's answer, never more rows than the
//! compute tier would have made of them. Work that does not shrink in a partial
//! aggregate (about one group per row, a median of every value) then costs the node
//! what it would have cost here, and the Parquet stays at the node.
//!
//! The node must hold the part's aggregation state in its memory, or spill it: a
//! part whose state the nodes' distinct-count sketches put above
//! `csd.whole_at_node_max_state` (a group's keys, accumulators and hash-table entry;
//! a median's or a `DISTINCT`'s every value) stays in two phases. Unknown groups (no
//! sketches): run whole, as a partial aggregate is pushed then.
//!
//! [`one_node_part`] finds such a part: projections, filters, subquery aliases,
//! aggregates of plain groupings and windows over a storage-node table, with at
//! least one aggregate. Its aggregates are those a fragment may hold in two phases
//! ([`AGGREGATES`]), over distinct values too, and those that shrink only whole
//! ([`WHOLE_AGGREGATES`]: a median). Its windows are ranking functions and those
//! aggregates over frames from the partition's start, or the current row, to the
//! current row or the partition's end (the frames Substrait carries whole). A
//! window's sort holds every row of its input, counted as state too. A node that is
//! busy or cannot run the part hands it back, and the compute tier runs it itself.

use arrow::datatypes::DataType;
use datafusion::common::tree_node::TreeNode;
use datafusion::logical_expr::{
    Aggregate, Expr, ExprSchemable, LogicalPlan, Window, WindowFrame, WindowFrameBound,
    WindowFrameUnits, WindowFunctionDefinition,
};

use crate::compute::provider::CsdTable;
use crate::compute::pushable::{aggregate_of, pushable};
use crate::compute::shrink::groups_of;
use crate::wire::fragment::{AGGREGATES, WHOLE_AGGREGATES, WINDOW_FUNCTIONS};

/// A part a single node runs whole.
#[derive(Debug, Clone)]
pub(crate) struct WholePart {
    /// The state its largest aggregate or window holds, by the sketches, when they
    /// know every aggregate's groups.
    pub state_bytes: Option<u64>,
}

/// What holds state in a part, top first.
enum Stage<'a> {
    Aggregate(&'a Aggregate),
    Window(&'a Window),
}

/// `plan` as a part a single node runs whole with at most `max_state` bytes of
/// state (see the module's documentation).
pub(crate) fn one_node_part(plan: &LogicalPlan, max_state: u64) -> Option<WholePart> {
    let mut stages = Vec::new();
    let table = part_over_table(plan, &mut stages)?;
    if !stages.iter().any(|s| matches!(s, Stage::Aggregate(_)))
        || table.at().per_node().endpoints().len() != 1
    {
        return None;
    }
    // Bottom up: an aggregate over another one has at most its groups as rows.
    let mut rows = Some(table.rows() as f64);
    let mut largest = 0.0f64;
    for stage in stages.iter().rev() {
        let Some((out, bytes)) = rows.and_then(|r| match stage {
            Stage::Aggregate(a) => aggregate_state(&table, a, r),
            Stage::Window(w) => Some((r, r * (row_width(&w.input) + PER_ROW))),
        }) else {
            rows = None;
            break;
        };
        largest = largest.max(bytes);
        rows = Some(out);
    }
    let state_bytes = rows.map(|_| largest as u64);
    match state_bytes {
        Some(b) if b > max_state => None,
        _ => Some(WholePart { state_bytes }),
    }
}

/// Hash-table entry, group index and batch slack per group, beyond its keys and
/// accumulators.
const PER_GROUP: f64 = 48.0;
/// An accumulator's state per group (a sum, a count, a mean's two).
const PER_ACCUMULATOR: f64 = 16.0;
/// A string's bytes (a view and a short value).
const PER_STRING: f64 = 24.0;
/// A value a median or a `DISTINCT` keeps.
const PER_VALUE: f64 = 8.0;
/// A sorted row's index and the sort's slack.
const PER_ROW: f64 = 16.0;

/// A value of type `t`, in bytes (strings and other variable widths: `PER_STRING`).
fn width(t: &DataType) -> f64 {
    t.primitive_width().map_or(PER_STRING, |w| w as f64)
}

/// A row of `plan`'s output, in bytes.
fn row_width(plan: &LogicalPlan) -> f64 {
    plan.schema()
        .fields()
        .iter()
        .map(|f| width(f.data_type()))
        .sum()
}

/// The groups of `a`, whose input has `rows` rows, and the state it holds at the
/// node: its groups' keys, accumulators and entries, and every value of its medians
/// and `DISTINCT`s. Its groups are the sketches' for keys of the table's columns,
/// one without keys, and at most its rows over an aggregate or a window; `None` when the
/// sketches do not know the columns' distinct values.
fn aggregate_state(table: &CsdTable, a: &Aggregate, rows: f64) -> Option<(f64, f64)> {
    let groups = if a.group_expr.is_empty() {
        1.0
    } else {
        match groups_of(table, &a.input, &a.group_expr) {
            Some(e) => e.groups.min(rows),
            None if over_stage(&a.input) => rows,
            None => return None,
        }
    };
    let schema = a.input.schema();
    let keys: f64 = a
        .group_expr
        .iter()
        .map(|g| g.get_type(schema).map_or(PER_STRING, |t| width(&t)))
        .sum();
    let every_value = a.aggr_expr.iter().filter(|e| keeps_every_value(e)).count() as f64;
    let accumulators = a.aggr_expr.len() as f64 - every_value;
    Some((
        groups,
        groups * (keys + PER_ACCUMULATOR * accumulators + PER_GROUP)
            + rows * PER_VALUE * every_value,
    ))
}

/// Whether an aggregate or a window lies under `plan`.
fn over_stage(plan: &LogicalPlan) -> bool {
    plan.exists(|p| {
        Ok(matches!(
            p,
            LogicalPlan::Aggregate(_) | LogicalPlan::Window(_)
        ))
    })
    .unwrap_or(false)
}

/// Whether an aggregate's state is its every (distinct) value.
fn keeps_every_value(e: &Expr) -> bool {
    match e {
        Expr::Alias(a) => keeps_every_value(&a.expr),
        Expr::AggregateFunction(f) => {
            f.params.distinct || WHOLE_AGGREGATES.contains(&f.func.name())
        }
        _ => false,
    }
}

/// The table under a chain of what a node runs whole, with its stages.
fn part_over_table<'a>(plan: &'a LogicalPlan, stages: &mut Vec<Stage<'a>>) -> Option<CsdTable> {
    match plan {
        LogicalPlan::Projection(p) if p.expr.iter().all(pushable) => {
            part_over_table(&p.input, stages)
        }
        LogicalPlan::Filter(f) if pushable(&f.predicate) => part_over_table(&f.input, stages),
        LogicalPlan::SubqueryAlias(a) => part_over_table(&a.input, stages),
        LogicalPlan::Aggregate(a)
            if a.group_expr
                .iter()
                .all(|g| !matches!(g, Expr::GroupingSet(_)) && pushable(g))
                && a.aggr_expr.iter().all(whole_aggregate) =>
        {
            stages.push(Stage::Aggregate(a));
            part_over_table(&a.input, stages)
        }
        LogicalPlan::Window(w) if w.window_expr.iter().all(whole_window) => {
            stages.push(Stage::Window(w));
            part_over_table(&w.input, stages)
        }
        // A scan's filters are there only because `CsdTable` took them as exact.
        LogicalPlan::TableScan(s) if s.fetch.is_none() => CsdTable::of_scan(s),
        _ => None,
    }
}

/// An aggregate a node computes exactly over all of a table's rows: one a fragment
/// may hold, over distinct values too.
fn whole_aggregate(e: &Expr) -> bool {
    aggregate_of(e, AGGREGATES, true) || aggregate_of(e, WHOLE_AGGREGATES, true)
}

/// A window function Substrait carries to the node unchanged: a ranking one or an
/// aggregate a fragment may hold, without `FILTER`, `DISTINCT` or `IGNORE NULLS`
/// (which its Substrait form drops), over a frame it keeps.
fn whole_window(e: &Expr) -> bool {
    match e {
        Expr::Alias(a) => whole_window(&a.expr),
        Expr::WindowFunction(w) => {
            let p = &w.params;
            let known = match &w.fun {
                WindowFunctionDefinition::AggregateUDF(f) => AGGREGATES.contains(&f.name()),
                WindowFunctionDefinition::WindowUDF(f) => WINDOW_FUNCTIONS.contains(&f.name()),
            };
            known
                && p.filter.is_none()
                && !p.distinct
                && p.null_treatment.is_none()
                && p.args.iter().all(pushable)
                && p.partition_by.iter().all(pushable)
                && p.order_by.iter().all(|s| pushable(&s.expr))
                && kept_frame(&p.window_frame)
        }
        _ => false,
    }
}

/// Frames whose Substrait form reads back the same: `ROWS` or `RANGE` from the
/// partition's start or the current row to the current row or the partition's end
/// (an offset's type is not carried).
fn kept_frame(f: &WindowFrame) -> bool {
    use WindowFrameBound::{CurrentRow, Following, Preceding};
    matches!(f.units, WindowFrameUnits::Rows | WindowFrameUnits::Range)
        && match &f.start_bound {
            Preceding(v) => v.is_null(),
            CurrentRow => true,
            Following(_) => false,
        }
        && match &f.end_bound {
            Following(v) => v.is_null(),
            CurrentRow => true,
            Preceding(_) => false,
        }
}
