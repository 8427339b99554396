//! Join-key filters on the compute side: the build side of a hash join tells the
//! storage nodes which keys its probe side can match.
//!
//! [`KeyFilterRule`] (a physical optimizer rule, run after DataFusion's) finds hash
//! joins whose join type drops probe rows that match nothing (inner, left
//! outer/semi/anti/mark, right semi) and whose probe side's key columns come from a
//! [`CsdScanExec`] reached through projections, filters, repartitions, coalesces,
//! inner joins and group columns of aggregates (see [`find_scan`]); a scan takes up
//! to `csd.max_key_filters` (at most [`MAX_FILTERS`]) such filters (none from a build side that is a whole,
//! unfiltered table). It wraps the build side in a [`KeyCollectExec`], which passes
//! the build rows through unchanged while hashing their keys, and hands the scan a
//! [`KeyCollector`] to wait on. A hash join reads
//! its whole build side before it first polls the probe side, so the scan waits for
//! nothing a plain join would not; once every build partition has ended, the scan
//! sends a bloom filter of the keys with its fragment (see [`crate::wire::keyfilter`]).
//!
//! The filter only ever drops probe rows that cannot match; the join above still
//! decides exactly. When there is no filter to send (the build side failed, had more
//! keys than a filter holds, or took longer than `csd.key_wait_secs`) the scan runs
//! unfiltered.

use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{JoinType, Result};
use datafusion::config::ConfigOptions;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::AggregateExec;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::HashJoinExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties, ReplaceChildrenOptions};

use crate::compute::key_collector::{KeyCollectExec, KeyCollector};
use crate::compute::scan::CsdScanExec;
use crate::options::CsdOptions;
use crate::wire::fragment::MAX_FILTERS;
use crate::wire::keyfilter::supported;

/// Most passes of [`KeyFilterRule`] over a plan (see its `optimize`).
const PASSES: usize = 3;

/// The physical rule (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct KeyFilterRule;

impl PhysicalOptimizerRule for KeyFilterRule {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let options = CsdOptions::of(config);
        // Bottom-up, so a join's probe side already carries the filters of the joins
        // below it. A join whose build side only becomes filtered by a join above it
        // (Q11's subquery: nation filters supplier, whose keys then filter partsupp
        // below it) is reached by the next pass; a pass never adds a filter a scan
        // already has, so the passes end.
        let mut plan = plan;
        for _ in 0..PASSES {
            let t = plan.transform_up(|p| {
                let Some(join) = p.downcast_ref::<HashJoinExec>() else {
                    return Ok(Transformed::no(p));
                };
                match attach(join, &options)? {
                    Some(children) => Ok(Transformed::yes(recompute(p.clone(), children)?)),
                    None => Ok(Transformed::no(p)),
                }
            })?;
            plan = t.data;
            if !t.transformed {
                break;
            }
        }
        Ok(plan)
    }

    fn name(&self) -> &str {
        "CsdKeyFilter"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Join keys a probe-side scan produces: the scan, its columns, the path to it (see
/// [`find_scan`]) and which of the join's keys they are.
struct KeysAt<'a> {
    scan: &'a CsdScanExec,
    cols: Vec<usize>,
    path: Vec<usize>,
    keys: Vec<usize>,
}

/// The join's new children when a key filter applies to its probe side.
fn attach(
    join: &HashJoinExec,
    options: &CsdOptions,
) -> Result<Option<Vec<Arc<dyn ExecutionPlan>>>> {
    // Join types whose output never includes a probe (right) row that matched
    // nothing, and whose build rows' matches cannot change when such rows go.
    let drops_unmatched_probe = matches!(
        join.join_type(),
        JoinType::Inner
            | JoinType::Left
            | JoinType::LeftSemi
            | JoinType::LeftAnti
            | JoinType::LeftMark
            | JoinType::RightSemi
    );
    if !drops_unmatched_probe || join.on().is_empty() || whole_table(join.left()) {
        return Ok(None);
    }
    let mut cols = Vec::new();
    for (_, r) in join.on() {
        match r.downcast_ref::<Column>() {
            Some(c) => cols.push(c.index()),
            None => return Ok(None),
        }
    }
    // The scan that produces the most key columns: when the keys come from several
    // tables (Q5 joins on a supplier and a nation key), filtering on some of them
    // still drops only probe rows that cannot match.
    let mut found: Vec<KeysAt> = Vec::new();
    for (k, &c) in cols.iter().enumerate() {
        let Some((scan, sc, path)) = find_scan(join.right(), c, Vec::new()) else {
            continue;
        };
        match found.iter_mut().find(|f| f.path == path) {
            Some(f) => {
                f.cols.push(sc);
                f.keys.push(k);
            }
            None => found.push(KeysAt {
                scan,
                cols: vec![sc],
                path,
                keys: vec![k],
            }),
        }
    }
    let Some(KeysAt {
        scan,
        cols: scan_cols,
        path,
        keys,
    }) = found.into_iter().max_by_key(|f| f.keys.len())
    else {
        return Ok(None);
    };
    let types = scan.schema();
    let existing = scan.key_filter_columns();
    if existing.len() >= options.max_key_filters.min(MAX_FILTERS)
        || existing.contains(&scan_cols)
        || !scan_cols
            .iter()
            .all(|&c| supported(types.field(c).data_type()))
    {
        return Ok(None);
    }
    let collector = Arc::new(KeyCollector::new(
        keys.iter().map(|&k| join.on()[k].0.clone()).collect(),
        join.left().output_partitioning().partition_count(),
        options.key_wait(),
        options.bloom_bits_per_key,
    ));
    let left: Arc<dyn ExecutionPlan> =
        Arc::new(KeyCollectExec::new(join.left().clone(), collector.clone()));
    let right = replace_at(join.right(), &path, &|s| {
        Arc::new(s.with_key_filter(collector.clone(), scan_cols.clone()))
    })?;
    Ok(Some(vec![left, right]))
}

/// Whether `build` is a whole table, unfiltered: its keys are every key the table
/// has, so a probe side joined on a foreign key keeps all its rows, and the filter
/// would only cost the nodes a hash and probe per row (Q13: 150,000 customer keys
/// tested against all 1.5 million orders).
fn whole_table(build: &Arc<dyn ExecutionPlan>) -> bool {
    if let Some(s) = build.downcast_ref::<CsdScanExec>() {
        return s.is_direct() && !s.has_key_filter();
    }
    if build.downcast_ref::<ProjectionExec>().is_some() || passes_rows(build) {
        return matches!(build.children()[..], [child] if whole_table(child));
    }
    false
}

/// Nodes a probe-side filter may look through: they keep every row and its columns.
fn passes_rows(p: &Arc<dyn ExecutionPlan>) -> bool {
    p.downcast_ref::<RepartitionExec>().is_some()
        || p.name() == "CoalesceBatchesExec"
        || p.downcast_ref::<CoalescePartitionsExec>().is_some()
        || p.name() == "CooperativeExec"
}

/// The scan under `plan` that produces column `col`, its index there, and the path
/// to it (child indexes from `plan`). The way down passes nodes that keep every row
/// ([`passes_rows`]), projections and filters that pass the column unchanged, and
/// inner hash joins: a row an inner join makes from a scan row carries that row's key,
/// so a scan row whose key the join above cannot match only ever makes rows that join
/// drops (Q5: the suppliers of one region filter `lineitem` below its join with
/// `orders`); and aggregates, on a group column (Q17: 105 parts filter the per-part
/// averages `lineitem` sends as partial aggregates, 200,000 groups a partition).
fn find_scan(
    plan: &Arc<dyn ExecutionPlan>,
    col: usize,
    mut path: Vec<usize>,
) -> Option<(&CsdScanExec, usize, Vec<usize>)> {
    if let Some(s) = plan.downcast_ref::<CsdScanExec>() {
        // A scan that returns partial aggregates is filtered on its output. The only
        // way to it is through its final aggregate, by a group column: never a state.
        return Some((s, col, path));
    }
    let (child, col) = if let Some(p) = plan.downcast_ref::<ProjectionExec>() {
        let e = p.projection_expr().iter().nth(col)?;
        (0, e.expr.downcast_ref::<Column>()?.index())
    } else if let Some(f) = plan.downcast_ref::<FilterExec>() {
        (
            0,
            f.projection()
                .as_deref()
                .map_or(Some(col), |p| p.get(col).copied())?,
        )
    } else if let Some(j) = plan.downcast_ref::<HashJoinExec>() {
        if *j.join_type() != JoinType::Inner {
            return None;
        }
        // Output: the left columns then the right ones, then the join's projection.
        let c = j
            .projection
            .as_deref()
            .map_or(Some(col), |p| p.get(col).copied())?;
        let left = j.left().schema().fields().len();
        if c < left { (0, c) } else { (1, c - left) }
    } else if let Some(a) = plan.downcast_ref::<AggregateExec>() {
        // A group column: dropping every input row of a group drops just that group's
        // output row, which the join above could not match. Not through grouping sets,
        // whose rolled-up rows mix groups.
        let g = a.group_expr();
        if !g.is_single() {
            return None;
        }
        let (e, _) = g.expr().get(col)?;
        (0, e.downcast_ref::<Column>()?.index())
    } else if passes_rows(plan) && plan.children().len() == 1 {
        (0, col)
    } else {
        return None;
    };
    path.push(child);
    find_scan(plan.children()[child], col, path)
}

/// `plan` with the scan at `path` (from [`find_scan`]) replaced by `f(scan)`.
fn replace_at(
    plan: &Arc<dyn ExecutionPlan>,
    path: &[usize],
    f: &dyn Fn(&CsdScanExec) -> Arc<dyn ExecutionPlan>,
) -> Result<Arc<dyn ExecutionPlan>> {
    let Some((&next, rest)) = path.split_first() else {
        return match plan.downcast_ref::<CsdScanExec>() {
            Some(s) => Ok(f(s)),
            None => Err(datafusion::common::DataFusionError::Internal(
                "join-key filter: no scan at the end of its path".into(),
            )),
        };
    };
    let children = plan
        .children()
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            if i == next {
                replace_at(c, rest, f)
            } else {
                Ok(c.clone())
            }
        })
        .collect::<Result<Vec<_>>>()?;
    recompute(plan.clone(), children)
}

fn recompute(
    plan: Arc<dyn ExecutionPlan>,
    children: Vec<Arc<dyn ExecutionPlan>>,
) -> Result<Arc<dyn ExecutionPlan>> {
    plan.replace_children(
        children,
        ReplaceChildrenOptions::new(datafusion::physical_plan::ChildrenPropertiesMode::Recompute),
    )
}
