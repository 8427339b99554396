//! Whether an aggregate shrinks at the nodes, judged before any node is asked.
//!
//! A partial aggregate at a node answers one row per group of the rows it reads
//! there. When its groups come near its rows — a GROUP BY over a key of millions of
//! values, several keys together, keys spread over every file — the node does the
//! work of a hash aggregate that reduces nothing, and sends about as many rows as it
//! read, as Arrow IPC, where compressed Parquet would have been smaller; the compute
//! tier then merges them all again. Reading the Parquet here is cheaper on both counts.
//!
//! The nodes keep a distinct-count sketch of every column of every object they
//! store, and list, per table, the union's estimate over the partitions each holds
//! (`TableDescription::distinct`). The groups a node would answer are at most the
//! product of its group keys' distinct values (one more for a nullable key's NULL)
//! and at most its rows: an upper bound, exact for independent keys. An aggregate
//! whose bound, summed over the nodes, is more than `csd.max_group_fraction` of the
//! rows they hold is planned here.

use datafusion::common::Column;
use datafusion::logical_expr::{Aggregate, Expr, LogicalPlan};

use crate::compute::provider::CsdTable;

/// The table column `c` of `plan`'s output is, when it is one, passed unchanged
/// through projections and filters.
pub(crate) fn base_column(plan: &LogicalPlan, c: &Column) -> Option<String> {
    traced(plan, c, false)?.pop()
}

/// The table columns that the column `c` of `plan`'s output is computed from,
/// through projections and filters: a group key of an expression (deterministic,
/// as what is pushed is) has at most the product of their distinct values.
fn source_columns(plan: &LogicalPlan, c: &Column) -> Option<Vec<String>> {
    traced(plan, c, true)
}

/// The table columns `c` comes from, through projections, filters, subquery aliases
/// and windows; through
/// computed expressions only when `computed` (else only a column passed unchanged).
fn traced(plan: &LogicalPlan, c: &Column, computed: bool) -> Option<Vec<String>> {
    match plan {
        LogicalPlan::Projection(p) => {
            let i = p.schema.index_of_column(c).ok()?;
            let e = p.expr.get(i)?.clone().unalias();
            if !computed && !matches!(e, Expr::Column(_)) {
                return None;
            }
            let mut columns = Vec::new();
            for inner in e.column_refs() {
                columns.extend(traced(&p.input, inner, computed)?);
            }
            Some(columns)
        }
        LogicalPlan::Filter(f) => traced(&f.input, c, computed),
        // A window passes its input's columns on (its own are computed from rows).
        LogicalPlan::Window(w) if w.input.schema().has_column(c) => traced(&w.input, c, computed),
        LogicalPlan::SubqueryAlias(a) => {
            let i = a.schema.index_of_column(c).ok()?;
            traced(
                &a.input,
                &Column::from(a.input.schema().qualified_field(i)),
                computed,
            )
        }
        LogicalPlan::TableScan(s) => {
            s.projected_schema.index_of_column(c).ok()?;
            Some(vec![c.name.clone()])
        }
        _ => None,
    }
}

/// What the nodes would answer for an aggregate, from their sketches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct GroupEstimate {
    /// Groups the nodes would answer together (each node's own groups, summed).
    pub groups: f64,
    /// Rows they hold.
    pub rows: f64,
}

impl GroupEstimate {
    /// Groups per row read.
    pub(crate) fn fraction(&self) -> f64 {
        if self.rows > 0.0 {
            self.groups / self.rows
        } else {
            0.0
        }
    }
}

/// The groups `a` (over `table`, through pushable projections and filters) would
/// leave its nodes with, before filters; `None` when a group key is not made of
/// table columns whose distinct counts every node knows.
pub(crate) fn groups_at_nodes(table: &CsdTable, a: &Aggregate) -> Option<GroupEstimate> {
    groups_of(table, &a.input, &a.group_expr)
}

/// The groups of `keys` (expressions over `input`, pushable projections and filters
/// over `table`) at the nodes, as for [`groups_at_nodes`]: also what a per-group
/// top-k (a window's `PARTITION BY`) keeps groups of.
pub(crate) fn groups_of(
    table: &CsdTable,
    input: &LogicalPlan,
    keys_of: &[Expr],
) -> Option<GroupEstimate> {
    let schema = table.at().schema().clone();
    // Each group key as the table columns it is computed from.
    let mut keys: Vec<usize> = Vec::new();
    for g in keys_of {
        for c in g.column_refs() {
            for name in source_columns(input, c)? {
                let i = schema.index_of(&name).ok()?;
                if !keys.contains(&i) {
                    keys.push(i);
                }
            }
        }
    }
    let (mut groups, mut rows) = (0.0f64, 0.0f64);
    for e in table.at().per_node().endpoints() {
        let n = e.rows as f64;
        let mut product = 1.0f64;
        for &k in &keys {
            let d = (*e.distinct.get(k)?)? as f64;
            let nulls = if schema.field(k).is_nullable() {
                1.0
            } else {
                0.0
            };
            product *= (d + nulls).max(1.0);
        }
        groups += product.min(n);
        rows += n;
    }
    Some(GroupEstimate { groups, rows })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fraction_of_no_rows_is_zero() {
        let e = GroupEstimate {
            groups: 3.0,
            rows: 0.0,
        };
        assert_eq!(e.fraction(), 0.0);
        let e = GroupEstimate {
            groups: 5.0,
            rows: 10.0,
        };
        assert_eq!(e.fraction(), 0.5);
    }
}
