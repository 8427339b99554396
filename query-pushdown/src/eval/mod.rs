//! Evaluating a fragment, on either side of the wire: the node runs every fragment it
//! admits here, and the compute tier runs here the fragments a node hands back. A
//! fragment is planned by DataFusion in a session of its own ([`fragment_session`],
//! [`plan_fragment`]) and filtered by its join-key filters ([`key_filtered`]).

pub(crate) mod decimal;
pub(crate) mod group_top_k;
pub(crate) mod keyfilter;
pub(crate) mod like;
pub(crate) mod rewrite;
pub(crate) mod running_window;
pub(crate) mod scan;
pub(crate) mod string_eq;
#[cfg(feature = "wasm")]
pub(crate) mod wasm;
#[cfg(feature = "wasm")]
pub(crate) mod wasm_fn;

use std::sync::{Arc, OnceLock};

use arrow::datatypes::DataType;
use csd_protocol::{Error, Result};
use datafusion::datasource::TableProvider;
use datafusion::execution::SessionStateBuilder;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::logical_expr::LogicalPlan;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties, Partitioning};
use datafusion::prelude::{SessionConfig, SessionContext};
use datafusion_substrait::logical_plan::consumer::from_substrait_plan;
use datafusion_substrait::substrait::proto::Plan;
use futures::FutureExt;

use crate::error::to_runtime;
use crate::eval::decimal::FastDecimal;
use crate::eval::group_top_k::GroupTopK;
use crate::eval::keyfilter::below_aggregate;
use crate::eval::like::FastLike;
use crate::eval::running_window::RunningWindow;
use crate::eval::string_eq::FastStringEq;
use crate::wire::fragment::{Mode, SqlFragment, validate};
use crate::wire::keyfilter::KeyFilter;

/// The physical optimizer rules fragments are planned with: DataFusion's, without
/// the one that would merge the partial/final aggregate split a fragment needs, and
/// then [`FastLike`] (multi-piece `LIKE` patterns without a regex), [`FastStringEq`]
/// (short string literals compared by view), [`FastDecimal`] (decimal arithmetic
/// without a checked multiply per value), [`GroupTopK`] (a ranking window's
/// per-group top-k kept before its sort) and [`RunningWindow`] (running totals a
/// batch at a time, in a part a node runs whole).
fn fragment_rules() -> Vec<Arc<dyn PhysicalOptimizerRule + Send + Sync>> {
    static RULES: OnceLock<Vec<Arc<dyn PhysicalOptimizerRule + Send + Sync>>> = OnceLock::new();
    RULES
        .get_or_init(|| {
            SessionStateBuilder::new()
                .with_default_features()
                .build()
                .physical_optimizers()
                .iter()
                .filter(|r| r.name() != "CombinePartialFinalAggregate")
                .cloned()
                .chain([
                    Arc::new(FastLike) as Arc<dyn PhysicalOptimizerRule + Send + Sync>,
                    Arc::new(FastStringEq),
                    Arc::new(FastDecimal),
                    Arc::new(GroupTopK),
                    Arc::new(RunningWindow),
                ])
                .collect()
        })
        .clone()
}

/// How many streams one fragment's scan is split into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parallelism {
    /// Streams (DataFusion partitions) per fragment: the Parquet objects' row groups
    /// are divided between them by byte range, and their outputs merged at the node
    /// (partial aggregate states are merged, not just concatenated).
    pub streams: usize,
    /// Objects smaller than this are not split.
    pub split_min_bytes: u64,
}

impl Parallelism {
    /// One stream: what the compute tier uses for fragments a node pushed back,
    /// which its gate runs a core at a time.
    pub(crate) const ONE: Parallelism = Parallelism {
        streams: 1,
        split_min_bytes: u64::MAX,
    };

    /// The node's default: four streams per fragment, objects of 10 MiB or more
    /// (DataFusion's own threshold) split. With as many streams as cores, a stream
    /// waiting for the device leaves its core idle; with twice as many, another
    /// stream decodes meanwhile, and a fragment that finishes early leaves its
    /// worker to the streams still running. The pool's fixed worker count still
    /// bounds the node's CPU (`csd serve --set sql.streams=N` changes it).
    pub const NODE: Parallelism = Parallelism {
        streams: 4,
        split_min_bytes: 10 << 20,
    };
}

impl Default for Parallelism {
    fn default() -> Self {
        Parallelism::NODE
    }
}

/// A session for running one fragment over `table` = `provider` in `parallel`
/// streams, with `runtime`'s memory pool and object stores. The node runs fragments
/// in it; so does the compute tier when a node pushes one back.
pub(crate) fn fragment_session(
    runtime: Arc<RuntimeEnv>,
    table: &str,
    provider: Arc<dyn TableProvider>,
    parallel: Parallelism,
    late_filters: bool,
) -> Result<SessionContext> {
    let mut config = scan::configure(
        SessionConfig::new()
            .with_target_partitions(parallel.streams.max(1))
            .with_batch_size(8192),
    );
    config.options_mut().execution.parquet.pushdown_filters = late_filters;
    config.options_mut().optimizer.repartition_file_min_size =
        usize::try_from(parallel.split_min_bytes).unwrap_or(usize::MAX);
    let state = SessionStateBuilder::new()
        .with_default_features()
        .with_config(config)
        .with_runtime_env(runtime)
        .with_physical_optimizer_rules(fragment_rules())
        .build();
    let session = SessionContext::new_with_state(state);
    session
        .register_table(table, provider)
        .map_err(to_runtime)?;
    Ok(session)
}

/// Validates `plan` (a fragment over `table` in `mode`) against the supported subset
/// and the functions `runs` accepts (at a node: what it evaluates exactly,
/// [`node_evaluates`](crate::wire::functions::node_evaluates); on the compute tier, anything its registry has), and plans
/// it: the output is one partition, partial aggregate states in
/// [`Mode::PartialAggregate`].
pub(crate) async fn plan_fragment(
    session: &SessionContext,
    table: &str,
    plan: &Plan,
    mode: Mode,
    runs: &(dyn Fn(&str) -> bool + Sync),
) -> Result<Arc<dyn ExecutionPlan>> {
    let state = session.state();
    validate(plan, table, runs)?;
    // Defence in depth: the checks above bound what reaches DataFusion's consumer;
    // should it still panic on some inconsistent plan, refuse the plan, not the node.
    let logical = std::panic::AssertUnwindSafe(from_substrait_plan(&state, plan))
        .catch_unwind()
        .await
        .map_err(|_| {
            Error::InvalidArgument(
                "the Substrait plan is inconsistent and cannot be planned".into(),
            )
        })?
        .map_err(|e| Error::InvalidArgument(format!("cannot plan the fragment: {e}")))?;
    check_logical(&logical, mode)?;
    let physical = state
        .create_physical_plan(&logical)
        .await
        .map_err(to_runtime)?;
    let physical = match mode {
        Mode::Complete => physical,
        Mode::PartialAggregate => partial_of(physical)?,
    };
    Ok(if physical.output_partitioning().partition_count() > 1 {
        Arc::new(CoalescePartitionsExec::new(physical))
    } else {
        physical
    })
}

/// `physical` (the planned `frag`) with the fragment's join-key filters, checked
/// against its output: those on plain group columns run under its partial aggregate
/// ([`below_aggregate`]); the rest are returned, to filter its output.
pub(crate) fn key_filtered(
    frag: &SqlFragment,
    physical: Arc<dyn ExecutionPlan>,
) -> Result<(Arc<dyn ExecutionPlan>, Vec<KeyFilter>)> {
    let types: Vec<DataType> = physical
        .schema()
        .fields()
        .iter()
        .map(|f| f.data_type().clone())
        .collect();
    let filters = frag
        .key_filters
        .iter()
        .map(|m| KeyFilter::from_msg(m, &types).map_err(Error::from))
        .collect::<Result<Vec<_>>>()?;
    below_aggregate(physical, filters).map_err(to_runtime)
}

/// Refuses volatile expressions (the node must compute exactly what the compute
/// tier would) and checks the plan's shape for partial aggregation.
fn check_logical(plan: &LogicalPlan, mode: Mode) -> Result<()> {
    use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
    let mut bad = None;
    let _ = plan.apply(|p| {
        for e in p.expressions() {
            if e.is_volatile() {
                bad = Some(format!("volatile expression {e} cannot be pushed down"));
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        Ok(TreeNodeRecursion::Continue)
    });
    if let Some(b) = bad {
        return Err(Error::InvalidArgument(b));
    }
    if mode == Mode::PartialAggregate {
        let mut p = plan;
        while let LogicalPlan::Projection(pr) = p {
            p = pr.input.as_ref();
        }
        if !matches!(p, LogicalPlan::Aggregate(_)) {
            return Err(Error::InvalidArgument(
                "PARTIAL_AGGREGATE needs an aggregate at the root of the plan".into(),
            ));
        }
    }
    Ok(())
}

/// The first aggregate at or below `plan`, through single-input nodes; `missing`
/// says what was expected when there is none.
fn first_aggregate(plan: Arc<dyn ExecutionPlan>, missing: &str) -> Result<Arc<dyn ExecutionPlan>> {
    let mut p = plan;
    while p.downcast_ref::<AggregateExec>().is_none() {
        let child = match p.children().as_slice() {
            [c] => (*c).clone(),
            _ => return Err(Error::Internal(missing.into())),
        };
        p = child;
    }
    Ok(p)
}

/// The input of the topmost final aggregate: partial states, one row per group and
/// partition.
fn partial_of(plan: Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    let top = first_aggregate(
        plan,
        "no final aggregate found in the partial-aggregate plan",
    )?;
    let Some(a) = top.downcast_ref::<AggregateExec>() else {
        return Err(Error::Internal(
            "first_aggregate returned a non-aggregate".into(),
        ));
    };
    match a.mode() {
        AggregateMode::Final | AggregateMode::FinalPartitioned => reduced(a),
        m => Err(Error::Internal(format!(
            "expected a final aggregate at the top of the plan, found {m:?}"
        ))),
    }
}

/// The partial states under `last` (the fragment's final aggregate), each group
/// once: when the partial aggregate ran over several partitions, their states are
/// merged (`PartialReduce`), each partition's groups hashed to one of as many
/// merges, which run side by side (one merge of every state would run on one core:
/// a million groups' states from four streams took the node longer than reading
/// them); the caller unites their outputs.
fn reduced(last: &AggregateExec) -> Result<Arc<dyn ExecutionPlan>> {
    let p = first_aggregate(
        last.input().clone(),
        "no partial aggregate under the final one",
    )?;
    let streams = p.output_partitioning().partition_count();
    if streams == 1 {
        return Ok(p);
    }
    // The final aggregate's group expressions are the partial output's group columns.
    let keys: Vec<Arc<dyn PhysicalExpr>> = last
        .group_expr()
        .expr()
        .iter()
        .map(|(e, _)| e.clone())
        .collect();
    let input: Arc<dyn ExecutionPlan> = if keys.is_empty() {
        Arc::new(CoalescePartitionsExec::new(p))
    } else {
        Arc::new(
            RepartitionExec::try_new(p, Partitioning::Hash(keys, streams)).map_err(to_runtime)?,
        )
    };
    let merged = AggregateExec::try_new(
        AggregateMode::PartialReduce,
        last.group_expr().clone(),
        last.aggr_expr().to_vec(),
        last.filter_expr().to_vec(),
        input,
        last.input_schema(),
    )
    .map_err(to_runtime)?;
    Ok(Arc::new(merged))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eval::keyfilter::apply_all;
    use crate::wire::keyfilter::{Bloom, hash_rows};
    use arrow::array::{ArrayRef, Int64Array, RecordBatch};
    use arrow::datatypes::{Field, Schema};
    use arrow::util::pretty::pretty_format_batches;
    use datafusion::datasource::MemTable;
    use datafusion::datasource::memory::MemorySourceConfig;
    use datafusion::physical_plan::collect;

    /// `t(k, v)`: 2,000 rows in two partitions, 50 keys, every key in both.
    async fn two_streams(sql: &str) -> (SessionContext, Arc<dyn ExecutionPlan>) {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("v", DataType::Int64, false),
        ]));
        let part = |from: i64| {
            let v: Vec<i64> = (from..from + 1000).collect();
            let k: Vec<i64> = v.iter().map(|x| x % 50).collect();
            vec![
                RecordBatch::try_new(
                    schema.clone(),
                    vec![
                        Arc::new(Int64Array::from(k)) as ArrayRef,
                        Arc::new(Int64Array::from(v)) as ArrayRef,
                    ],
                )
                .unwrap(),
            ]
        };
        let state = SessionStateBuilder::new()
            .with_default_features()
            .with_config(SessionConfig::new().with_target_partitions(2))
            .with_physical_optimizer_rules(fragment_rules())
            .build();
        let ctx = SessionContext::new_with_state(state);
        let t = MemTable::try_new(schema.clone(), vec![part(0), part(1000)]).unwrap();
        ctx.register_table("t", Arc::new(t)).unwrap();
        let plan = ctx
            .sql(sql)
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap();
        (ctx, plan)
    }

    /// The rows of `batches`, as text, sorted (column names and widths left out).
    fn sorted(batches: &[RecordBatch]) -> Vec<String> {
        let text = pretty_format_batches(batches).unwrap().to_string();
        let lines: Vec<&str> = text.lines().collect();
        let mut rows: Vec<String> = lines[3..lines.len().saturating_sub(1)]
            .iter()
            .map(|l| l.split('|').map(str::trim).collect::<Vec<_>>().join("|"))
            .collect();
        rows.sort();
        rows
    }

    #[tokio::test]
    async fn partial_states_of_several_streams_leave_once_per_group() {
        let sql = "SELECT k, sum(v), count(*), avg(v) FROM t GROUP BY k";
        let (ctx, physical) = two_streams(sql).await;
        let states = partial_of(physical.clone()).unwrap();
        let merge = states
            .downcast_ref::<AggregateExec>()
            .expect("an aggregate on top");
        assert_eq!(merge.mode(), &AggregateMode::PartialReduce);
        assert_eq!(
            states.output_partitioning().partition_count(),
            2,
            "the states merge in as many hash partitions as streams, side by side"
        );
        let out = collect(states.clone(), ctx.task_ctx()).await.unwrap();
        let groups: usize = out.iter().map(RecordBatch::num_rows).sum();
        assert_eq!(groups, 50, "each group once, not once per stream");

        // The compute tier's final aggregate over these states gives the answer.
        let top = first_aggregate(physical.clone(), "final aggregate").unwrap();
        let last = top.downcast_ref::<AggregateExec>().unwrap();
        let input = MemorySourceConfig::try_new_exec(&[out], states.schema(), None).unwrap();
        let fin = AggregateExec::try_new(
            AggregateMode::Final,
            last.group_expr().clone(),
            last.aggr_expr().to_vec(),
            last.filter_expr().to_vec(),
            input,
            last.input_schema(),
        )
        .unwrap();
        let got = collect(Arc::new(fin), ctx.task_ctx()).await.unwrap();
        let want = ctx.sql(sql).await.unwrap().collect().await.unwrap();
        assert_eq!(sorted(&got), sorted(&want));
    }

    fn filter_on(column: usize, keys: &[i64]) -> KeyFilter {
        let a: ArrayRef = Arc::new(Int64Array::from(keys.to_vec()));
        let (hashes, _) = hash_rows(&[a], keys.len()).unwrap();
        KeyFilter::new(vec![column], Bloom::with_keys(&hashes).unwrap())
    }

    #[tokio::test]
    async fn key_filters_on_group_columns_run_before_aggregating() {
        let (ctx, physical) = two_streams("SELECT k, sum(v) FROM t GROUP BY k").await;
        let states = partial_of(physical).unwrap();
        let filter = filter_on(0, &[3, 7, 11]);
        let above = collect(states.clone(), ctx.task_ctx()).await.unwrap();
        let above: Vec<RecordBatch> = above
            .into_iter()
            .map(|b| apply_all(std::slice::from_ref(&filter), b).unwrap())
            .collect();
        let (below, rest) = below_aggregate(states, vec![filter]).unwrap();
        assert!(
            rest.is_empty(),
            "a filter on a plain group column moves down"
        );
        let shown = datafusion::physical_plan::displayable(below.as_ref())
            .indent(false)
            .to_string();
        let (agg, filter) = (
            shown.find("mode=Partial,").expect("partial aggregate"),
            shown.find("KeyFilterExec").expect("filter node"),
        );
        assert!(
            agg < filter,
            "the filter runs under the partial aggregate:\n{shown}"
        );
        let got = collect(below, ctx.task_ctx()).await.unwrap();
        assert_eq!(sorted(&got), sorted(&above));
        let groups: usize = got.iter().map(RecordBatch::num_rows).sum();
        assert!((3..10).contains(&groups), "{groups} groups");
    }

    #[tokio::test]
    async fn key_filters_reach_a_whole_aggregate_under_a_projection() {
        // A COMPLETE fragment: a projection over the final aggregate; the filter is
        // on its second output column, the group key.
        let sql = "SELECT sum(v) * 2 AS s, k FROM t GROUP BY k";
        let (ctx, physical) = two_streams(sql).await;
        let filter = filter_on(1, &[3, 7, 11]);
        let above = collect(physical.clone(), ctx.task_ctx()).await.unwrap();
        let above: Vec<RecordBatch> = above
            .into_iter()
            .map(|b| apply_all(std::slice::from_ref(&filter), b).unwrap())
            .collect();
        let (below, rest) = below_aggregate(physical, vec![filter]).unwrap();
        assert!(rest.is_empty(), "the group key passes the projection");
        let shown = datafusion::physical_plan::displayable(below.as_ref())
            .indent(false)
            .to_string();
        let filter_at = shown.find("KeyFilterExec").expect("filter node");
        let last_agg = shown.rfind("AggregateExec").expect("aggregate");
        assert!(
            last_agg < filter_at,
            "the filter runs under every aggregate:\n{shown}"
        );
        let got = collect(below, ctx.task_ctx()).await.unwrap();
        assert_eq!(sorted(&got), sorted(&above));
        let groups: usize = got.iter().map(RecordBatch::num_rows).sum();
        assert!((3..10).contains(&groups), "{groups} groups");
    }

    #[tokio::test]
    async fn key_filters_on_computed_group_columns_stay_on_the_output() {
        let (_, physical) = two_streams("SELECT k + 1 AS j, sum(v) FROM t GROUP BY k + 1").await;
        let states = partial_of(physical).unwrap();
        let (plan, rest) = below_aggregate(states, vec![filter_on(0, &[4])]).unwrap();
        assert_eq!(rest.len(), 1);
        let shown = datafusion::physical_plan::displayable(plan.as_ref())
            .indent(false)
            .to_string();
        assert!(!shown.contains("KeyFilterExec"), "{shown}");
    }
}
