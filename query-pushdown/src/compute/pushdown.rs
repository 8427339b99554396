//! Pushing more than a scan: partial aggregates and top-k.
//!
//! DataFusion's `TableProvider` API pushes projection, filters and limits into
//! [`CsdTable::scan`](crate::compute::provider::CsdTable). [`PushdownRule`] (a logical optimizer
//! rule, run after DataFusion's own) finds, over a scan of a storage-node table, a
//! chain of pushable projections and filters topped by
//!
//! * an `Aggregate` of `sum`/`count`/`min`/`max`/`avg` with plain GROUP BY: the whole
//!   aggregate becomes a [`CsdPushdown`] node. When planned, DataFusion's own two-phase
//!   plan is built and its `Partial` aggregate is replaced by a [`CsdScanExec`] that
//!   asks every node for exactly that partial state (`PARTIAL_AGGREGATE` mode), so the
//!   final merge is DataFusion's own — `avg` is merged from sums and counts, never
//!   averaged twice;
//! * a `Sort` with a fetch (ORDER BY … LIMIT k): the sort runs at every node (top-k
//!   per partition) and stays above to merge;
//! * an aggregate grouped by a column whose values never span two partitions (the
//!   partitions' ranges of it, from exact footer statistics, are disjoint: TPC-H's
//!   `l_orderkey`, or any table partitioned by key range), with the pushable
//!   filters (HAVING) and projections above it: the whole aggregate runs at every
//!   partition ([`PushKind::WholeAggregate`]) and the compute tier only unites the
//!   results. The fragment names the objects the ranges came from, and the node
//!   refuses it if the partition has changed since.
//!
//! Anything else stays where DataFusion put it.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{Column, DFSchemaRef, DataFusionError, Result};
use datafusion::datasource::source_as_provider;
use datafusion::execution::context::QueryPlanner;
use datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext;
use datafusion::logical_expr::{
    Aggregate, Expr, Extension, LogicalPlan, Sort, UserDefinedLogicalNode,
    UserDefinedLogicalNodeCore,
};
use datafusion::optimizer::{OptimizerConfig, OptimizerRule};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_planner::{DefaultPhysicalPlanner, ExtensionPlanner, PhysicalPlanner};

use crate::compute::provider::{CsdTable, describe, session_state};
use crate::compute::pushable::{pushable, pushable_aggregate};
use crate::compute::scan::CsdScanExec;
use crate::wire::fragment::Mode;

/// What a [`CsdPushdown`] pushes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd)]
pub(crate) enum PushKind {
    /// The partial phase of the aggregate at the fragment's root.
    PartialAggregate,
    /// The sort-with-fetch at the fragment's root, per node partition.
    TopK,
    /// The whole fragment (an aggregate whose groups never span partitions, and
    /// filters/projections over it) per partition; results united here.
    WholeAggregate,
}

/// A logical subtree that runs at the storage nodes (shown as its child in EXPLAIN).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd)]
pub(crate) struct CsdPushdown {
    kind: PushKind,
    fragment: LogicalPlan,
    /// The column whose disjoint ranges make the fragment's aggregate complete per
    /// partition (the fragment then pins the partitions' objects).
    disjoint_on: Option<String>,
}

impl UserDefinedLogicalNodeCore for CsdPushdown {
    fn name(&self) -> &str {
        "CsdPushdown"
    }
    fn inputs(&self) -> Vec<&LogicalPlan> {
        vec![&self.fragment]
    }
    fn schema(&self) -> &DFSchemaRef {
        self.fragment.schema()
    }
    fn expressions(&self) -> Vec<Expr> {
        vec![]
    }
    fn fmt_for_explain(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let what = match self.kind {
            PushKind::PartialAggregate => {
                "partial aggregate at the storage nodes, final merge here"
            }
            PushKind::TopK => "top-k at every storage-node partition, merged here",
            PushKind::WholeAggregate => "whole aggregate at every storage-node partition",
        };
        write!(f, "CsdPushdown: {what}")?;
        if let Some(c) = &self.disjoint_on {
            write!(f, " (partitions hold disjoint ranges of {c})")?;
        }
        Ok(())
    }
    fn with_exprs_and_inputs(
        &self,
        _exprs: Vec<Expr>,
        mut inputs: Vec<LogicalPlan>,
    ) -> Result<Self> {
        let fragment = inputs
            .pop()
            .ok_or_else(|| DataFusionError::Internal("CsdPushdown needs its fragment".into()))?;
        Ok(CsdPushdown {
            kind: self.kind,
            fragment,
            disjoint_on: self.disjoint_on.clone(),
        })
    }
}

/// The logical rule (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct PushdownRule;

/// The storage-node table under a chain of pushable projections and filters, if any.
fn csd_source(plan: &LogicalPlan) -> Option<CsdTable> {
    match plan {
        LogicalPlan::Projection(p) if p.expr.iter().all(pushable) => csd_source(&p.input),
        LogicalPlan::Filter(f) if pushable(&f.predicate) => csd_source(&f.input),
        // A scan's filters are there only because `CsdTable` took them as exact.
        LogicalPlan::TableScan(s) if s.fetch.is_none() => {
            let provider = source_as_provider(&s.source).ok()?;
            provider.downcast_ref::<CsdTable>().cloned()
        }
        _ => None,
    }
}

fn wrap(kind: PushKind, fragment: LogicalPlan, disjoint_on: Option<String>) -> LogicalPlan {
    LogicalPlan::Extension(Extension {
        node: Arc::new(CsdPushdown {
            kind,
            fragment,
            disjoint_on,
        }),
    })
}

/// An aggregate the nodes can run: plain pushable groupings and aggregates over a
/// storage-node table (through pushable projections and filters).
fn pushable_aggregate_over_table(a: &Aggregate) -> Option<CsdTable> {
    if a.group_expr
        .iter()
        .all(|g| !matches!(g, Expr::GroupingSet(_)) && pushable(g))
        && a.aggr_expr.iter().all(pushable_aggregate)
    {
        csd_source(&a.input)
    } else {
        None
    }
}

/// The table column `c` of `plan`'s output is, when it is one, passed unchanged
/// through projections and filters.
fn base_column(plan: &LogicalPlan, c: &Column) -> Option<String> {
    match plan {
        LogicalPlan::Projection(p) => {
            let i = p.schema.index_of_column(c).ok()?;
            match p.expr.get(i)?.clone().unalias() {
                Expr::Column(inner) => base_column(&p.input, &inner),
                _ => None,
            }
        }
        LogicalPlan::Filter(f) => base_column(&f.input, c),
        LogicalPlan::TableScan(s) => {
            s.projected_schema.index_of_column(c).ok()?;
            Some(c.name.clone())
        }
        _ => None,
    }
}

/// When `plan` is pushable filters/projections over an aggregate of a storage-node
/// table grouped by (among others) a column whose ranges are disjoint across the
/// table's partitions: that column.
fn whole_aggregate(plan: &LogicalPlan) -> Option<String> {
    match plan {
        LogicalPlan::Projection(p) if p.expr.iter().all(pushable) => whole_aggregate(&p.input),
        LogicalPlan::Filter(f) if pushable(&f.predicate) => whole_aggregate(&f.input),
        LogicalPlan::Aggregate(a) => {
            let table = pushable_aggregate_over_table(a)?;
            a.group_expr.iter().find_map(|g| match g {
                Expr::Column(c) => base_column(&a.input, c).filter(|name| table.disjoint_on(name)),
                _ => None,
            })
        }
        _ => None,
    }
}

impl OptimizerRule for PushdownRule {
    fn name(&self) -> &str {
        "csd_pushdown"
    }

    fn rewrite(
        &self,
        plan: LogicalPlan,
        _config: &dyn OptimizerConfig,
    ) -> Result<Transformed<LogicalPlan>> {
        // Into subqueries too: DataFusion keeps uncorrelated scalar subqueries (Q15's
        // `max`, Q22's average) as expressions, and gives a rule without an
        // `apply_order` only the root.
        plan.transform_down_with_subqueries(|p| {
            if let LogicalPlan::Extension(e) = &p
                && e.node.as_any().is::<CsdPushdown>()
            {
                return Ok(Transformed::new(p, false, TreeNodeRecursion::Jump));
            }
            if let Some(column) = whole_aggregate(&p) {
                return Ok(Transformed::new(
                    wrap(PushKind::WholeAggregate, p, Some(column)),
                    true,
                    TreeNodeRecursion::Jump,
                ));
            }
            match &p {
                LogicalPlan::Aggregate(a) if pushable_aggregate_over_table(a).is_some() => {
                    Ok(Transformed::new(
                        wrap(PushKind::PartialAggregate, p, None),
                        true,
                        TreeNodeRecursion::Jump,
                    ))
                }
                LogicalPlan::Sort(s)
                    if s.fetch.is_some() && s.expr.iter().all(|e| pushable(&e.expr)) =>
                {
                    let disjoint_on = whole_aggregate(&s.input);
                    if disjoint_on.is_none() && csd_source(&s.input).is_none() {
                        return Ok(Transformed::no(p));
                    }
                    let pushed = wrap(PushKind::TopK, p.clone(), disjoint_on);
                    let merged = LogicalPlan::Sort(Sort {
                        expr: s.expr.clone(),
                        input: Arc::new(pushed),
                        fetch: s.fetch,
                    });
                    Ok(Transformed::new(merged, true, TreeNodeRecursion::Jump))
                }
                _ => Ok(Transformed::no(p)),
            }
        })
    }
}

/// Plans [`CsdPushdown`] nodes.
#[derive(Debug, Default)]
pub(crate) struct CsdExtensionPlanner;

fn table_of(fragment: &LogicalPlan) -> Result<CsdTable> {
    let mut found = None;
    fragment.apply(|p| {
        if let LogicalPlan::TableScan(s) = p
            && let Ok(provider) = source_as_provider(&s.source)
            && let Some(t) = provider.downcast_ref::<CsdTable>()
        {
            found = Some(t.clone());
            return Ok(TreeNodeRecursion::Stop);
        }
        Ok(TreeNodeRecursion::Continue)
    })?;
    found.ok_or_else(|| {
        DataFusionError::Internal("pushed fragment has no storage-node table".into())
    })
}

#[async_trait]
impl ExtensionPlanner for CsdExtensionPlanner {
    async fn plan_extension(
        &self,
        _planner: &dyn PhysicalPlanner,
        node: &dyn UserDefinedLogicalNode,
        _logical_inputs: &[&LogicalPlan],
        physical_inputs: &[Arc<dyn ExecutionPlan>],
        session: &dyn Session,
        _ctx: &PhysicalPlanningContext,
    ) -> Result<Option<Arc<dyn ExecutionPlan>>> {
        let Some(node) = node.as_any().downcast_ref::<CsdPushdown>() else {
            return Ok(None);
        };
        let state = session_state(session)?;
        let table = table_of(&node.fragment)?;
        let (plan, functions) = match table.substrait(&node.fragment, state)? {
            Ok(e) => (e.plan, e.functions),
            // Past what a node takes: the fragment as DataFusion planned it here
            // (its scan still pushes what each filter alone may).
            Err(why) => {
                tracing::debug!(table = table.name(), "fragment not pushed: {why}");
                return Ok(physical_inputs.first().cloned());
            }
        };
        let what = describe(&node.fragment);
        match node.kind {
            PushKind::TopK | PushKind::WholeAggregate => {
                let schema = Arc::new(node.fragment.schema().as_arrow().clone());
                let mut scan =
                    CsdScanExec::new(table.at().clone(), schema, plan, Mode::Complete, what)
                        .with_functions(functions);
                if node.kind == PushKind::WholeAggregate {
                    // As DataFusion would estimate it here: an aggregate keeps its
                    // input's rows, each filter (HAVING too) keeps 20%. Lets its join
                    // choose the smaller build side.
                    let fraction = 0.2f64.powi(filters_in(&node.fragment));
                    scan = scan.with_estimate(Some(fraction), None);
                }
                if node.disjoint_on.is_some() {
                    scan = scan.pinned();
                }
                Ok(Some(Arc::new(scan)))
            }
            PushKind::PartialAggregate => {
                // DataFusion's own two-phase plan, with the partial phase at the nodes.
                let local = physical_inputs.first().cloned().ok_or_else(|| {
                    DataFusionError::Internal("CsdPushdown planned without input".into())
                })?;
                let mut replaced = 0;
                let out = local.clone().transform_down(|p| {
                    if let Some(a) = p.downcast_ref::<AggregateExec>()
                        && *a.mode() == AggregateMode::Partial
                    {
                        replaced += 1;
                        let scan: Arc<dyn ExecutionPlan> = Arc::new(
                            CsdScanExec::new(
                                Arc::new(table.at().per_node()),
                                a.schema(),
                                plan.clone(),
                                Mode::PartialAggregate,
                                what.clone(),
                            )
                            .with_functions(functions.clone()),
                        );
                        return Ok(Transformed::new(scan, true, TreeNodeRecursion::Jump));
                    }
                    Ok(Transformed::no(p))
                })?;
                if replaced == 1 {
                    Ok(Some(out.data))
                } else {
                    // Not the expected shape: run it all here (correct, just not pushed).
                    tracing::warn!(replaced, "aggregate not split as expected; not pushed");
                    Ok(Some(local))
                }
            }
        }
    }
}

/// Filters in `plan`: `Filter` nodes and scans with filters.
fn filters_in(plan: &LogicalPlan) -> i32 {
    let mut n = 0;
    let _ = plan.apply(|p| {
        match p {
            LogicalPlan::Filter(_) => n += 1,
            LogicalPlan::TableScan(s) if !s.filters.is_empty() => n += 1,
            _ => {}
        }
        Ok(TreeNodeRecursion::Continue)
    });
    n
}

/// DataFusion's planner plus [`CsdExtensionPlanner`].
#[derive(Debug, Default)]
pub(crate) struct CsdQueryPlanner;

#[async_trait]
impl QueryPlanner for CsdQueryPlanner {
    async fn create_physical_plan(
        &self,
        logical_plan: &LogicalPlan,
        session: &dyn Session,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        DefaultPhysicalPlanner::with_extension_planners(vec![Arc::new(CsdExtensionPlanner)])
            .create_physical_plan(logical_plan, session)
            .await
    }
}
