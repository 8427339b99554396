//! Join-key filters on the compute side: the build side of a hash join tells the
//! storage nodes which keys its probe side can match.
//!
//! [`SemiJoinRule`] (a physical optimizer rule, run after DataFusion's) finds hash
//! joins whose join type drops probe rows that match nothing (inner, left
//! outer/semi/anti/mark, right semi) and whose probe side's key columns come from a
//! [`CsdScanExec`] reached through projections, filters, repartitions, coalesces,
//! inner joins and group columns of aggregates (see [`find_scan`]); a scan takes up
//! to [`MAX_FILTERS`] such filters (none from a build side that is a whole,
//! unfiltered table). It wraps the build side in a [`KeyCollectExec`], which passes
//! the build rows through unchanged while hashing their keys, and hands the scan a
//! [`KeyCollector`] to wait on. A hash join reads
//! its whole build side before it first polls the probe side, so the scan waits for
//! nothing a plain join would not; once every build partition has ended, the scan
//! sends a [`Bloom`] of the keys with its fragment (see [`crate::keyfilter`]).
//!
//! The filter only ever drops probe rows that cannot match; the join above still
//! decides exactly. When there is no filter to send (the build side failed, had more
//! keys than a filter holds, or took longer than [`WAIT`]) the scan runs unfiltered.

use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use arrow::array::ArrayRef;
use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{JoinType, Result};
use datafusion::config::ConfigOptions;
use datafusion::execution::TaskContext;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::AggregateExec;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::HashJoinExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PhysicalExpr,
    PlanProperties, RecordBatchStream, ReplaceChildrenOptions, SendableRecordBatchStream,
};
use futures::Stream;
use tokio::sync::watch;

use crate::exec::CsdScanExec;
use crate::fragment::MAX_FILTERS;
use crate::keyfilter::{BITS_PER_KEY, Bloom, MAX_FILTER_BYTES, hash_rows, supported};

/// Longest a probe-side scan waits for the build side's keys before it runs
/// unfiltered (a safeguard: a hash join has read its build side before it polls the
/// probe side, so the wait is normally for sibling partitions only).
pub const WAIT: Duration = Duration::from_secs(30);
/// Most distinct keys a filter is built for ([`BITS_PER_KEY`] each, within
/// [`MAX_FILTER_BYTES`]).
const MAX_KEYS: usize = MAX_FILTER_BYTES * 8 / BITS_PER_KEY;
/// Most passes of [`SemiJoinRule`] over a plan (see its `optimize`).
const PASSES: usize = 3;

/// The keys of one hash join's build side, collected as its partitions run.
#[derive(Debug)]
pub struct KeyCollector {
    exprs: Vec<Arc<dyn PhysicalExpr>>,
    parts: usize,
    state: Mutex<Collect>,
    done: watch::Sender<bool>,
    built: OnceLock<Option<Arc<Bloom>>>,
}

#[derive(Debug, Default)]
struct Collect {
    hashes: Vec<u64>,
    finished: usize,
    abandoned: Option<String>,
    keys: usize,
}

impl KeyCollector {
    /// Collects `exprs` (the join's build-side keys) from `parts` partitions.
    pub fn new(exprs: Vec<Arc<dyn PhysicalExpr>>, parts: usize) -> Self {
        KeyCollector {
            exprs,
            parts,
            state: Mutex::new(Collect::default()),
            done: watch::channel(false).0,
            built: OnceLock::new(),
        }
    }

    fn add(&self, batch: &RecordBatch) -> std::result::Result<(), String> {
        let cols: Vec<ArrayRef> = self
            .exprs
            .iter()
            .map(|e| {
                e.evaluate(batch)
                    .and_then(|v| v.into_array(batch.num_rows()))
                    .map_err(|e| e.to_string())
            })
            .collect::<std::result::Result<_, _>>()?;
        let (hashes, valid) = hash_rows(&cols, batch.num_rows())?;
        let mut s = self.state.lock().map_err(|_| "key collector poisoned")?;
        if s.abandoned.is_some() {
            return Ok(());
        }
        s.hashes.extend(
            hashes
                .into_iter()
                .zip(valid)
                .filter_map(|(h, v)| v.then_some(h)),
        );
        if s.hashes.len() > 2 * MAX_KEYS {
            // Duplicates may still bring it under; check before giving up.
            s.hashes.sort_unstable();
            s.hashes.dedup();
            if s.hashes.len() > MAX_KEYS {
                drop(s);
                self.abandon(format!("more than {MAX_KEYS} distinct build keys"));
            }
        }
        Ok(())
    }

    fn finish_part(&self) {
        let all = match self.state.lock() {
            Ok(mut s) => {
                s.finished += 1;
                s.finished >= self.parts
            }
            Err(_) => true,
        };
        if all {
            self.done.send_replace(true);
        }
    }

    fn abandon(&self, why: String) {
        if let Ok(mut s) = self.state.lock()
            && s.abandoned.is_none()
        {
            tracing::debug!("join-key filter abandoned: {why}");
            s.abandoned = Some(why);
            s.hashes = Vec::new();
        }
        self.done.send_replace(true);
    }

    /// The filter, once every build partition has ended (`None`: no filter, see the
    /// module docs). Built once, shared by every endpoint of the scan.
    pub async fn wait(&self) -> Option<Arc<Bloom>> {
        let mut rx = self.done.subscribe();
        if tokio::time::timeout(WAIT, rx.wait_for(|d| *d))
            .await
            .is_err()
        {
            self.abandon(format!("build side not finished after {WAIT:?}"));
        }
        self.built
            .get_or_init(|| {
                let mut s = self.state.lock().ok()?;
                if s.abandoned.is_some() {
                    return None;
                }
                let mut h = std::mem::take(&mut s.hashes);
                h.sort_unstable();
                h.dedup();
                s.keys = h.len();
                Bloom::with_keys(&h).map(Arc::new)
            })
            .clone()
    }

    /// Distinct keys in the built filter (0 before it is built).
    pub fn keys(&self) -> usize {
        self.state.lock().map(|s| s.keys).unwrap_or(0)
    }

    /// Why there is no filter, if there is none.
    pub fn abandoned(&self) -> Option<String> {
        self.state.lock().ok().and_then(|s| s.abandoned.clone())
    }
}

/// Passes a hash join's build side through unchanged, collecting its keys.
#[derive(Debug)]
pub struct KeyCollectExec {
    input: Arc<dyn ExecutionPlan>,
    collector: Arc<KeyCollector>,
}

impl KeyCollectExec {
    /// Wraps `input`, feeding `collector`.
    pub fn new(input: Arc<dyn ExecutionPlan>, collector: Arc<KeyCollector>) -> Self {
        KeyCollectExec { input, collector }
    }
}

impl DisplayAs for KeyCollectExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "KeyCollectExec: join keys for the storage nodes")?;
        let keys = self.collector.keys();
        if keys > 0 {
            write!(f, ", keys={keys}")?;
        }
        if let Some(why) = self.collector.abandoned() {
            write!(f, ", no filter ({why})")?;
        }
        Ok(())
    }
}

impl ExecutionPlan for KeyCollectExec {
    fn name(&self) -> &str {
        "KeyCollectExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.input.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        for e in &self.collector.exprs {
            if f(e)? == TreeNodeRecursion::Stop {
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        Ok(TreeNodeRecursion::Continue)
    }

    fn replace_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
        _: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        match children.pop() {
            Some(input) if children.is_empty() => Ok(Arc::new(KeyCollectExec {
                input,
                collector: self.collector.clone(),
            })),
            _ => Err(datafusion::common::DataFusionError::Internal(
                "KeyCollectExec takes one child".into(),
            )),
        }
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.replace_children(
            children,
            ReplaceChildrenOptions::new(
                datafusion::physical_plan::ChildrenPropertiesMode::Recompute,
            ),
        )
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let inner = self.input.execute(partition, context)?;
        Ok(Box::pin(CollectStream {
            inner,
            collector: self.collector.clone(),
            ended: false,
        }))
    }
}

struct CollectStream {
    inner: SendableRecordBatchStream,
    collector: Arc<KeyCollector>,
    ended: bool,
}

impl Stream for CollectStream {
    type Item = Result<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let polled = self.inner.as_mut().poll_next(cx);
        match &polled {
            Poll::Ready(Some(Ok(b))) => {
                if let Err(e) = self.collector.add(b) {
                    self.collector.abandon(e);
                }
            }
            Poll::Ready(Some(Err(e))) => {
                self.collector.abandon(format!("build side failed: {e}"));
            }
            Poll::Ready(None) if !self.ended => {
                self.ended = true;
                self.collector.finish_part();
            }
            _ => {}
        }
        polled
    }
}

impl RecordBatchStream for CollectStream {
    fn schema(&self) -> SchemaRef {
        self.inner.schema()
    }
}

impl Drop for CollectStream {
    fn drop(&mut self) {
        if !self.ended {
            self.collector
                .abandon("build side stopped before its end".into());
        }
    }
}

/// The physical rule (see the module docs).
#[derive(Debug, Default)]
pub struct SemiJoinRule;

impl PhysicalOptimizerRule for SemiJoinRule {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
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
                match attach(join)? {
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
        "CsdSemiJoin"
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
fn attach(join: &HashJoinExec) -> Result<Option<Vec<Arc<dyn ExecutionPlan>>>> {
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
    if existing.len() >= MAX_FILTERS
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
