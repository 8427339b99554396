//! `DimensionJoinDown`: an inner join with a small, filtered input moved below the
//! inner joins that feed it, to the table its key comes from.
//!
//! DataFusion keeps the join order of the query's FROM clause, so a selective
//! dimension often joins last: TPC-H Q21 joins `lineitem ⋈ supplier ⋈ orders` on
//! whole tables (3.8M, then 1.8M rows) and only then `nation` with `n_name = 'SAUDI
//! ARABIA'`, which keeps 4% of them. Inner joins reassociate:
//!
//! ```text
//! (A ⋈ B) ⋈ D  =  (A ⋈ D) ⋈ B      when D's join key comes from A
//! ```
//!
//! so the rule moves the join with `D` through projections that pass its key columns
//! unchanged and through inner joins, down to the first input that is neither (in
//! Q21: `supplier ⋈ nation`, 411 suppliers). [`crate::compute::key_filter_rule`] then sends those
//! keys to the storage nodes as a join-key filter on the big table's scan
//! (`lineitem` returns 4% of its rows), and the joins above run on the survivors.
//! A join filter of the moved join that needs other columns stays on top as a filter.
//!
//! It moves `D` only when `D` is filtered and its estimated rows are fewer than those
//! of every input it passes (so two dimensions never trade places back and forth).
//! Estimates are crude: a table's rows from the storage nodes, a fifth per filter
//! conjunct, a foreign-key join keeps the big side's rows times the small side's
//! selectivity. Any input it cannot estimate stops the move.

use std::sync::Arc;

use datafusion::common::tree_node::Transformed;
use datafusion::common::{Column, Result};
use datafusion::logical_expr::utils::split_conjunction;
use datafusion::logical_expr::{
    Expr, Filter, Join, JoinConstraint, JoinType, LogicalPlan, Projection,
};
use datafusion::optimizer::{OptimizerConfig, OptimizerRule};

use crate::compute::provider::CsdTable;
use crate::compute::semijoin_down::{keys_below, rejoin, rewrite_joins};

/// The logical rule (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct DimensionJoinDown;

impl OptimizerRule for DimensionJoinDown {
    fn name(&self) -> &str {
        "csd_dimension_join_down"
    }

    fn rewrite(
        &self,
        plan: LogicalPlan,
        _config: &dyn OptimizerConfig,
    ) -> Result<Transformed<LogicalPlan>> {
        rewrite_joins(plan, moved)
    }
}

/// Rows estimated for a plan, and for the same plan without its filters.
#[derive(Debug, Clone, Copy)]
struct Card {
    rows: f64,
    base: f64,
}

impl Card {
    fn selective(self) -> bool {
        self.rows < self.base
    }
}

/// A fifth of the rows per filter conjunct (DataFusion's own default selectivity).
const PER_FILTER: f64 = 0.2;

fn estimate(plan: &LogicalPlan) -> Option<Card> {
    match plan {
        LogicalPlan::TableScan(t) => {
            let table = CsdTable::of_scan(t)?;
            let base = table.rows() as f64;
            let conjuncts: usize = t.filters.iter().map(|f| split_conjunction(f).len()).sum();
            let mut rows = base * PER_FILTER.powi(conjuncts as i32);
            if let Some(n) = t.fetch {
                rows = rows.min(n as f64);
            }
            Some(Card { rows, base })
        }
        LogicalPlan::Filter(f) => {
            let c = estimate(&f.input)?;
            let n = split_conjunction(&f.predicate).len();
            Some(Card {
                rows: c.rows * PER_FILTER.powi(n as i32),
                base: c.base,
            })
        }
        LogicalPlan::Projection(p) => estimate(&p.input),
        LogicalPlan::SubqueryAlias(a) => estimate(&a.input),
        LogicalPlan::Sort(s) => estimate(&s.input),
        LogicalPlan::Join(j) => {
            let (l, r) = (estimate(&j.left)?, estimate(&j.right)?);
            match j.join_type {
                JoinType::Inner if !j.on.is_empty() => {
                    let (big, small) = if l.base >= r.base { (l, r) } else { (r, l) };
                    Some(Card {
                        rows: big.rows * (small.rows / small.base.max(1.0)),
                        base: big.base,
                    })
                }
                JoinType::LeftSemi | JoinType::LeftAnti => Some(Card {
                    rows: l.rows * 0.5,
                    base: l.base,
                }),
                JoinType::RightSemi | JoinType::RightAnti => Some(Card {
                    rows: r.rows * 0.5,
                    base: r.base,
                }),
                _ => None,
            }
        }
        _ => None,
    }
}

/// A plain inner equi-join, the only kind moved or moved through.
fn plain_inner(j: &Join) -> bool {
    j.join_type == JoinType::Inner
        && j.join_constraint == JoinConstraint::On
        && !j.on.is_empty()
        && !j.null_aware
}

/// `j` with its dimension input moved down, with the output `j` had, or `None`.
fn moved(j: &Join) -> Result<Option<LogicalPlan>> {
    if !plain_inner(j) {
        return Ok(None);
    }
    for dim_is_right in [true, false] {
        let (rest, dim) = if dim_is_right {
            (&j.left, &j.right)
        } else {
            (&j.right, &j.left)
        };
        let Some(card) = estimate(dim).filter(|c| c.selective()) else {
            continue;
        };
        let mut keys = Vec::with_capacity(j.on.len());
        let mut dim_keys = Vec::with_capacity(j.on.len());
        for (l, r) in &j.on {
            let (k, d) = if dim_is_right { (l, r) } else { (r, l) };
            match k {
                Expr::Column(c) => keys.push(c.clone()),
                _ => break,
            }
            dim_keys.push(d.clone());
        }
        if keys.len() != j.on.len() {
            continue;
        }
        let down = Down {
            join: j,
            dim,
            dim_keys: &dim_keys,
            rows: card.rows,
        };
        let Some(mut plan) = down.below(rest, &keys)? else {
            continue;
        };
        if let Some(f) = &j.filter {
            plan = LogicalPlan::Filter(Filter::try_new(f.clone(), Arc::new(plan))?);
        }
        let exprs = j.schema.columns().into_iter().map(Expr::Column).collect();
        return Ok(Some(LogicalPlan::Projection(
            Projection::try_new_with_schema(exprs, Arc::new(plan), j.schema.clone())?,
        )));
    }
    Ok(None)
}

/// The join being moved: its dimension input, the dimension's side of its keys and
/// the dimension's estimated rows.
struct Down<'a> {
    join: &'a Join,
    dim: &'a Arc<LogicalPlan>,
    dim_keys: &'a [Expr],
    rows: f64,
}

impl Down<'_> {
    /// `input ⋈ dim` (on `keys` of `input`) with the join below `input`'s root, or
    /// `None` when it passes no inner join.
    fn below(&self, input: &LogicalPlan, keys: &[Column]) -> Result<Option<LogicalPlan>> {
        match input {
            LogicalPlan::Projection(p) => {
                let Some(inner) = keys_below(p, keys) else {
                    return Ok(None);
                };
                let Some(moved) = self.below(&p.input, &inner)? else {
                    return Ok(None);
                };
                let mut exprs = p.expr.clone();
                exprs.extend(self.dim.schema().columns().into_iter().map(Expr::Column));
                Ok(Some(LogicalPlan::Projection(Projection::try_new(
                    exprs,
                    Arc::new(moved),
                )?)))
            }
            LogicalPlan::Join(x) if plain_inner(x) => {
                let in_left = keys.iter().all(|k| x.left.schema().has_column(k));
                let in_right = keys.iter().all(|k| x.right.schema().has_column(k));
                let (target, sibling) = match (in_left, in_right) {
                    (true, false) => (&x.left, &x.right),
                    (false, true) => (&x.right, &x.left),
                    _ => return Ok(None),
                };
                // Only past a bigger input: a smaller one filters at least as well.
                if estimate(sibling).is_none_or(|s| s.rows <= self.rows) {
                    return Ok(None);
                }
                let moved = Arc::new(self.at(target, keys)?);
                let (left, right) = if in_left {
                    (moved, x.right.clone())
                } else {
                    (x.left.clone(), moved)
                };
                Ok(Some(rejoin(x, left, right)?))
            }
            _ => Ok(None),
        }
    }

    /// `input ⋈ dim`, moved below `input` where it can.
    fn at(&self, input: &Arc<LogicalPlan>, keys: &[Column]) -> Result<LogicalPlan> {
        if let Some(moved) = self.below(input, keys)? {
            return Ok(moved);
        }
        let on = keys
            .iter()
            .zip(self.dim_keys)
            .map(|(k, d)| (Expr::Column(k.clone()), d.clone()))
            .collect();
        Ok(LogicalPlan::Join(Join::try_new(
            input.clone(),
            self.dim.clone(),
            on,
            None,
            JoinType::Inner,
            JoinConstraint::On,
            self.join.null_equality,
            false,
        )?))
    }
}
