//! A per-group top-k under a ranking window, found for pushing down.
//!
//! `WHERE rn <= k` over `row_number() / rank() / dense_rank() OVER (PARTITION BY p
//! ORDER BY o) AS rn` keeps at most the first `k` rows of each group (all ties, for
//! `rank` and `dense_rank`). Each node can keep, of its own rows, those whose rank
//! among them is at most `k`: a row's rank among a subset of the rows is never above
//! its rank among them all, so every row of the answer is among what the nodes keep
//! (with `row_number`, whose ties fall either way, the rows kept still hold a first
//! `k` of every group). The compute tier then runs the window and the filter, as
//! planned, over what the nodes sent: per group, at most `k` rows a node (plus ties),
//! instead of every row. `rn = k` keeps a subset of `rn <= k`, so it pushes the same.
//!
//! [`ranked_filter`] finds the window and `k` under a filter; the rule in
//! `pushdown.rs` swaps the window's input for the pushed fragment it builds with
//! [`top_k_fragment`].

use std::sync::Arc;

use datafusion::common::{Column, Result, ScalarValue};
use datafusion::logical_expr::expr::WindowFunction;
use datafusion::logical_expr::utils::split_conjunction;
use datafusion::logical_expr::{
    BinaryExpr, Expr, Filter, LogicalPlan, LogicalPlanBuilder, Operator, Window, lit,
};

use crate::compute::pushable::pushable;
use crate::wire::fragment::WINDOW_FUNCTIONS;

/// A filter's per-group top-k over a ranking window.
pub(crate) struct RankedFilter<'a> {
    /// The window computing the rank.
    pub window: &'a Window,
    /// Which of its window expressions is the rank.
    pub expr: usize,
    /// The rows kept per group (ties aside).
    pub k: u64,
}

/// The column `name` of `plan`'s output traced down through projections and
/// aliases to the window that computes it: the window and the expression's index.
fn window_column<'a>(plan: &'a LogicalPlan, c: &Column) -> Option<(&'a Window, usize)> {
    match plan {
        LogicalPlan::SubqueryAlias(a) => {
            let i = a.schema.index_of_column(c).ok()?;
            let (q, f) = a.input.schema().qualified_field(i);
            window_column(&a.input, &Column::from((q, f)))
        }
        LogicalPlan::Projection(p) => {
            let i = p.schema.index_of_column(c).ok()?;
            match p.expr.get(i)?.clone().unalias() {
                Expr::Column(inner) => window_column(&p.input, &inner),
                _ => None,
            }
        }
        LogicalPlan::Window(w) => {
            let i = w.schema.index_of_column(c).ok()?;
            let first = w.input.schema().fields().len();
            (i >= first).then_some((w, i - first))
        }
        _ => None,
    }
}

/// An integer literal's value, at least 1.
fn positive(e: &Expr) -> Option<u64> {
    match e {
        Expr::Literal(v, _) => {
            let n = match v {
                ScalarValue::Int8(Some(n)) => i64::from(*n),
                ScalarValue::Int16(Some(n)) => i64::from(*n),
                ScalarValue::Int32(Some(n)) => i64::from(*n),
                ScalarValue::Int64(Some(n)) => *n,
                ScalarValue::UInt8(Some(n)) => i64::from(*n),
                ScalarValue::UInt16(Some(n)) => i64::from(*n),
                ScalarValue::UInt32(Some(n)) => i64::from(*n),
                ScalarValue::UInt64(Some(n)) => i64::try_from(*n).ok()?,
                _ => return None,
            };
            u64::try_from(n).ok().filter(|n| *n >= 1)
        }
        Expr::Cast(c) => positive(&c.expr),
        Expr::TryCast(c) => positive(&c.expr),
        _ => None,
    }
}

/// `rank_column <op> k` as (column, most rows per group kept), in either order.
fn bound(e: &Expr) -> Option<(&Column, u64)> {
    let Expr::BinaryExpr(BinaryExpr { left, op, right }) = e else {
        return None;
    };
    fn col(e: &Expr) -> Option<&Column> {
        match e {
            Expr::Column(c) => Some(c),
            Expr::Cast(c) => match c.expr.as_ref() {
                Expr::Column(c) => Some(c),
                _ => None,
            },
            _ => None,
        }
    }
    let (c, op, k) = match (col(left), col(right)) {
        (Some(c), None) => (c, *op, positive(right)?),
        (None, Some(c)) => (c, op.swap()?, positive(left)?),
        _ => return None,
    };
    let k = match op {
        Operator::LtEq | Operator::Eq => k,
        Operator::Lt => k.checked_sub(1).filter(|k| *k >= 1)?,
        _ => return None,
    };
    Some((c, k))
}

/// Whether `e` is a ranking window function over plain, pushable partitioning and
/// ordering, with a PARTITION BY (a global top-k is a sort with a fetch).
fn ranking(e: &Expr) -> bool {
    let Expr::WindowFunction(w) = e.clone().unalias() else {
        return false;
    };
    let WindowFunction { fun, params } = w.as_ref();
    WINDOW_FUNCTIONS.contains(&fun.name())
        && params.args.is_empty()
        && params.filter.is_none()
        && !params.distinct
        && !params.partition_by.is_empty()
        && params.partition_by.iter().all(pushable)
        && params.order_by.iter().all(|s| pushable(&s.expr))
}

/// The per-group top-k `f` keeps over a ranking window, if it is one.
pub(crate) fn ranked_filter(f: &Filter) -> Option<RankedFilter<'_>> {
    split_conjunction(&f.predicate).into_iter().find_map(|c| {
        let (column, k) = bound(c)?;
        let (window, expr) = window_column(&f.input, column)?;
        ranking(window.window_expr.get(expr)?).then_some(RankedFilter { window, expr, k })
    })
}

/// The fragment a node runs for `r`: the window's input ranked by the same
/// expression alone, its rows of rank at most `k` kept, and the input's columns
/// (so it stands in for the window's input).
pub(crate) fn top_k_fragment(r: &RankedFilter<'_>) -> Result<LogicalPlan> {
    let input = r.window.input.as_ref().clone();
    let columns: Vec<Expr> = (0..input.schema().fields().len())
        .map(|i| Expr::Column(Column::from(input.schema().qualified_field(i))))
        .collect();
    let ranked = LogicalPlanBuilder::from(input)
        .window(vec![r.window.window_expr[r.expr].clone()])?
        .build()?;
    let last = ranked.schema().fields().len() - 1;
    let rank = Expr::Column(Column::from(ranked.schema().qualified_field(last)));
    LogicalPlanBuilder::from(ranked)
        .filter(rank.lt_eq(lit(r.k)))?
        .project(columns)?
        .build()
}

/// `window` with `input` in place of its own.
pub(crate) fn with_input(window: &Window, input: LogicalPlan) -> Result<LogicalPlan> {
    Ok(LogicalPlan::Window(Window::try_new(
        window.window_expr.clone(),
        Arc::new(input),
    )?))
}
