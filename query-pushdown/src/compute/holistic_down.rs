//! Exact medians with a partial state that shrinks.
//!
//! `median`'s partial state is every value of its group, so a pushed median sends
//! the rows it read. But a median needs only the multiset of values, and the
//! multiset is (value, count) pairs: over a measure of few distinct values (a
//! rating, a quantity, a price in cents) per group, far fewer than the rows. So
//!
//! ```text
//! SELECT k, median(x), sum(y), count(*) FROM t GROUP BY k
//! ```
//!
//! is split into an aggregate the nodes run, grouped by the keys and the value,
//!
//! ```text
//! SELECT k, x, count(x) AS n, sum(y) AS s, count(*) AS c FROM t GROUP BY k, x
//! ```
//!
//! and one here over its answer: `median_weighted(x, n)` (the same median, see
//! `median_weighted.rs`), `sum(s)`, `sum(c)`. Only `sum`, `count`, `min` and `max`
//! may stand beside the medians (they merge exactly over the finer groups), and all
//! the medians must be of one value. Whether it pays is judged as any pushed
//! aggregate is (`shrink.rs`): by the groups of the keys and the value, from the
//! nodes' sketches; otherwise the query is planned as written.

use std::sync::Arc;

use datafusion::common::{Column, Result};
use datafusion::functions::core::expr_fn::coalesce;
use datafusion::functions_aggregate::expr_fn::{count, max, min, sum};
use datafusion::logical_expr::expr::AggregateFunction;
use datafusion::logical_expr::{
    Aggregate, Cast, Expr, ExprSchemable, LogicalPlan, Projection, lit,
};

use crate::compute::median_weighted::{median_weighted_udaf, supports};
use crate::compute::pushable::{pushable, pushable_aggregate};

/// How one of the aggregate's expressions is computed from the nodes' answer.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Part {
    Median,
    Count,
    Sum,
    Min,
    Max,
}

/// An aggregate split in two: `inner` for the nodes, the rest to build the one
/// above it.
#[derive(Debug, Clone)]
pub(crate) struct Split {
    /// The aggregate grouped by the original keys and the medians' value.
    pub inner: Aggregate,
    original: Aggregate,
    parts: Vec<Part>,
}

/// The medians' argument and how each aggregate is computed, when `a` can be split.
fn parts(a: &Aggregate) -> Option<(Expr, Vec<Part>)> {
    if a.group_expr
        .iter()
        .any(|g| matches!(g, Expr::GroupingSet(_)) || !pushable(g))
    {
        return None;
    }
    let mut value: Option<Expr> = None;
    let mut parts = Vec::with_capacity(a.aggr_expr.len());
    for e in &a.aggr_expr {
        let Expr::AggregateFunction(f) = e.clone().unalias() else {
            return None;
        };
        let plain = !f.params.distinct && f.params.filter.is_none() && f.params.order_by.is_empty();
        let part = match f.func.name() {
            "median" if plain && f.params.args.len() == 1 && pushable(&f.params.args[0]) => {
                // Without the name common-subexpression elimination gives it.
                let x = f.params.args[0].clone().unalias();
                match &value {
                    Some(v) if *v != x => return None,
                    _ => value = Some(x),
                }
                Part::Median
            }
            "count" if pushable_aggregate(e) => Part::Count,
            "sum" if pushable_aggregate(e) => Part::Sum,
            "min" if pushable_aggregate(e) => Part::Min,
            "max" if pushable_aggregate(e) => Part::Max,
            _ => return None,
        };
        parts.push(part);
    }
    let value = value?;
    // A median of a group key is that key; nothing to split.
    (!a.group_expr.contains(&value)).then_some((value, parts))
}

/// `a` split for the nodes, when it holds a median that can be split (see the
/// module): the caller judges whether `inner` shrinks.
pub(crate) fn split(a: &Aggregate) -> Result<Option<Split>> {
    let Some((value, parts)) = parts(a) else {
        return Ok(None);
    };
    if !supports(&value.get_type(a.input.schema())?) {
        return Ok(None);
    }
    let mut group = a.group_expr.clone();
    group.push(value.clone());
    let mut aggregates = vec![count(value).alias("__csd_median_count")];
    for (i, (e, p)) in a.aggr_expr.iter().zip(&parts).enumerate() {
        if *p != Part::Median {
            aggregates.push(e.clone().unalias().alias(format!("__csd_part_{i}")));
        }
    }
    let inner = Aggregate::try_new(a.input.clone(), group, aggregates)?;
    Ok(Some(Split {
        inner,
        original: a.clone(),
        parts,
    }))
}

impl Split {
    /// The aggregate above `pushed` (the nodes' `inner`), with the original's output
    /// names and types.
    pub(crate) fn assemble(self, pushed: LogicalPlan) -> Result<LogicalPlan> {
        let schema = pushed.schema().clone();
        let column = |i: usize| Expr::Column(Column::from(schema.qualified_field(i)));
        let keys = self.original.group_expr.len();
        let group: Vec<Expr> = (0..keys).map(column).collect();
        let (value, counted) = (column(keys), column(keys + 1));
        let mut next = keys + 2;
        let mut aggregates = Vec::with_capacity(self.parts.len());
        for (i, p) in self.parts.iter().enumerate() {
            let merged = match p {
                Part::Median => Expr::AggregateFunction(AggregateFunction::new_udf(
                    median_weighted_udaf(),
                    vec![value.clone(), counted.clone()],
                    false,
                    None,
                    vec![],
                    None,
                )),
                other => {
                    let part = column(next);
                    next += 1;
                    match other {
                        Part::Count | Part::Sum => sum(part),
                        Part::Min => min(part),
                        Part::Max => max(part),
                        Part::Median => unreachable!("matched above"),
                    }
                }
            };
            aggregates.push(merged.alias(format!("__csd_merged_{i}")));
        }
        let outer =
            LogicalPlan::Aggregate(Aggregate::try_new(Arc::new(pushed), group, aggregates)?);
        let merged = outer.schema().clone();
        let mut exprs = Vec::with_capacity(merged.fields().len());
        for i in 0..merged.fields().len() {
            let (qualifier, field) = self.original.schema.qualified_field(i);
            let mut e = Expr::Column(Column::from(merged.qualified_field(i)));
            // A count over no rows is 0, a sum of counts over none NULL.
            if i >= keys && self.parts[i - keys] == Part::Count {
                e = coalesce(vec![e, lit(0i64)]);
            }
            // A sum of sums is wider than the sum (decimals).
            if e.get_type(&merged)? != *field.data_type() {
                e = Expr::Cast(Cast::new(Box::new(e), field.data_type().clone()));
            }
            exprs.push(e.alias_qualified(qualifier.cloned(), field.name()));
        }
        Ok(LogicalPlan::Projection(Projection::try_new(
            exprs,
            Arc::new(outer),
        )?))
    }
}
