//! `SemiJoinDown`: a semi join moved below the inner joins that feed it, to the
//! table its key comes from.
//!
//! SQL puts `IN`/`EXISTS` subqueries in the WHERE clause, and DataFusion's
//! decorrelation leaves the resulting semi join on top of the query's other joins
//! (TPC-H Q18: `(customer ⋈ orders ⋈ lineitem) ⋉ heavy_orders`). The joins below then
//! run on whole tables. But a semi join on columns of one input of an inner join
//! commutes with it:
//!
//! ```text
//! (A ⋈ B) ⋉ S  =  A ⋈ (B ⋉ S)      when the semi-join key comes from B
//! ```
//!
//! so the rule moves it through projections that pass its key columns unchanged and
//! through inner joins, to just above the first node that is neither (a scan, a
//! filter, an aggregate, an outer join, …). There the semi join keeps only `B`'s rows
//! with a matching key, and [`crate::compute::key_filter_rule`] can send the subquery's keys to the
//! storage nodes as a join-key filter on `B`'s scan. It stops above filters, so a
//! filter still runs before the semi join. Semi joins with a non-equi filter stay
//! where they are, and so do anti joins: the same algebra holds for them, but a key
//! filter cannot express "not in", so moving one gains nothing and costs the inner
//! join's own key filter on `B`.

use std::sync::Arc;

use datafusion::common::tree_node::Transformed;
use datafusion::common::{Column, Result};
use datafusion::logical_expr::{Expr, Join, JoinType, LogicalPlan, Projection};
use datafusion::optimizer::{OptimizerConfig, OptimizerRule};

/// The logical rule (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct SemiJoinDown;

impl OptimizerRule for SemiJoinDown {
    fn name(&self) -> &str {
        "csd_semi_join_down"
    }

    fn rewrite(
        &self,
        plan: LogicalPlan,
        _config: &dyn OptimizerConfig,
    ) -> Result<Transformed<LogicalPlan>> {
        rewrite_joins(plan, moved)
    }
}

/// Rewrites `plan` top-down, replacing each join for which `f` returns a plan.
pub(crate) fn rewrite_joins(
    plan: LogicalPlan,
    f: impl Fn(&Join) -> Result<Option<LogicalPlan>>,
) -> Result<Transformed<LogicalPlan>> {
    plan.transform_down_with_subqueries(|p| {
        let LogicalPlan::Join(j) = &p else {
            return Ok(Transformed::no(p));
        };
        Ok(match f(j)? {
            Some(m) => Transformed::yes(m),
            None => Transformed::no(p),
        })
    })
}

/// `j` moved down, when it is a semi join on columns that can move.
fn moved(j: &Join) -> Result<Option<LogicalPlan>> {
    if j.join_type != JoinType::LeftSemi || j.filter.is_some() {
        return Ok(None);
    }
    let Some(keys) =
        j.on.iter()
            .map(|(l, _)| match l {
                Expr::Column(c) => Some(c.clone()),
                _ => None,
            })
            .collect::<Option<Vec<Column>>>()
    else {
        return Ok(None);
    };
    below(j, &j.left, &keys)
}

/// `input ⋉ semi.right` with the semi join as deep in `input` as it goes, or `None`
/// when it cannot move below `input`'s root.
fn below(semi: &Join, input: &LogicalPlan, keys: &[Column]) -> Result<Option<LogicalPlan>> {
    match input {
        LogicalPlan::Projection(p) => {
            let Some(inner) = keys_below(p, keys) else {
                return Ok(None);
            };
            let moved = at(semi, &p.input, &inner)?;
            Ok(Some(LogicalPlan::Projection(
                Projection::try_new_with_schema(p.expr.clone(), Arc::new(moved), p.schema.clone())?,
            )))
        }
        LogicalPlan::Join(j) if j.join_type == JoinType::Inner => {
            let (left, right) = if keys.iter().all(|k| j.left.schema().has_column(k)) {
                (Arc::new(at(semi, &j.left, keys)?), j.right.clone())
            } else if keys.iter().all(|k| j.right.schema().has_column(k)) {
                (j.left.clone(), Arc::new(at(semi, &j.right, keys)?))
            } else {
                return Ok(None);
            };
            Ok(Some(rejoin(j, left, right)?))
        }
        _ => Ok(None),
    }
}

/// `keys` (columns of `p`'s output) as `p`'s input names them, when `p` passes each
/// of them unchanged (a plain column, perhaps renamed); `None` otherwise.
pub(crate) fn keys_below(p: &Projection, keys: &[Column]) -> Option<Vec<Column>> {
    keys.iter()
        .map(|k| {
            let i = p.schema.index_of_column(k).ok()?;
            match p.expr.get(i).cloned().map(Expr::unalias) {
                Some(Expr::Column(c)) => Some(c),
                _ => None,
            }
        })
        .collect()
}

/// Join `j` (its keys, filter and kind) over new inputs.
pub(crate) fn rejoin(
    j: &Join,
    left: Arc<LogicalPlan>,
    right: Arc<LogicalPlan>,
) -> Result<LogicalPlan> {
    Ok(LogicalPlan::Join(Join::try_new(
        left,
        right,
        j.on.clone(),
        j.filter.clone(),
        j.join_type,
        j.join_constraint,
        j.null_equality,
        j.null_aware,
    )?))
}

/// The semi join applied to `input` (on `keys` of it), moved below it where it can.
fn at(semi: &Join, input: &Arc<LogicalPlan>, keys: &[Column]) -> Result<LogicalPlan> {
    if let Some(moved) = below(semi, input, keys)? {
        return Ok(moved);
    }
    let on = keys
        .iter()
        .zip(&semi.on)
        .map(|(k, (_, r))| (Expr::Column(k.clone()), r.clone()))
        .collect();
    Ok(LogicalPlan::Join(Join::try_new(
        input.clone(),
        semi.right.clone(),
        on,
        None,
        semi.join_type,
        semi.join_constraint,
        semi.null_equality,
        false,
    )?))
}
