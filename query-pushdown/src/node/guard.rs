//! A partial aggregate the compute tier could not judge before running (its objects
//! carry no distinct-count sketches), judged while it runs: DataFusion's own
//! partial-aggregation probe counts a stream's groups over its first rows and, above
//! the fragment's `shrink_above`, stops aggregating. Here that is the node's cue to
//! hand the fragment back: [`ShrinkGuardExec`] sits on each partial aggregate, holds
//! what it emits until its input ends, and fails its stream with a pushback as soon
//! as the aggregate has skipped a row — so nothing has been sent and the compute
//! tier evaluates the fragment itself.

use std::fmt;
use std::sync::Arc;

use arrow::array::RecordBatch;
use csd_protocol::{Error, PushBack, PushBackCause};
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties, SendableRecordBatchStream,
};
use futures::StreamExt;

/// The metric DataFusion's partial aggregate counts the rows it passed on
/// unaggregated with.
const SKIPPED: &str = "skipped_aggregation_rows";

/// `plan` with every partial aggregate under a [`ShrinkGuardExec`].
pub(crate) fn guarded(
    plan: Arc<dyn ExecutionPlan>,
    fraction: f32,
) -> Result<Arc<dyn ExecutionPlan>> {
    plan.transform_up(|p| match p.downcast_ref::<AggregateExec>() {
        Some(a) if *a.mode() == AggregateMode::Partial => {
            let guard: Arc<dyn ExecutionPlan> = Arc::new(ShrinkGuardExec {
                input: p.clone(),
                fraction,
            });
            Ok(Transformed::yes(guard))
        }
        _ => Ok(Transformed::no(p)),
    })
    .map(|t| t.data)
}

/// Passes a partial aggregate's batches on until the aggregate stops aggregating,
/// then fails with a pushback (see the module docs).
#[derive(Debug)]
pub(crate) struct ShrinkGuardExec {
    input: Arc<dyn ExecutionPlan>,
    fraction: f32,
}

impl DisplayAs for ShrinkGuardExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "ShrinkGuardExec: hand back above {:.0}% groups per row",
            100.0 * self.fraction
        )
    }
}

impl ExecutionPlan for ShrinkGuardExec {
    fn name(&self) -> &str {
        "ShrinkGuardExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.input.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn replace_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
        _: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let [input] = &children[..] else {
            return Err(DataFusionError::Internal(
                "ShrinkGuardExec takes one input".into(),
            ));
        };
        Ok(Arc::new(ShrinkGuardExec {
            input: input.clone(),
            fraction: self.fraction,
        }))
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.replace_children(
            children,
            ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute),
        )
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let input = self.input.clone();
        let fraction = self.fraction;
        let stream = self.input.execute(partition, context)?;
        let schema = stream.schema();
        let skipped = move || {
            input
                .metrics()
                .and_then(|m| m.sum_by_name(SKIPPED))
                .map_or(0, |v| v.as_usize())
        };
        // A partial aggregate that decides to skip first emits the groups it holds,
        // then its input's rows as states: what it emits is held until it either
        // skips (a pushback, nothing sent) or ends (all of it sent), or grows past
        // `HOLD_AT_MOST` (an early emission under memory pressure: passed on).
        let (mut held, mut bytes, mut holding, mut failed) = (Vec::new(), 0usize, true, false);
        let checked = stream
            .map(Some)
            .chain(futures::stream::once(async { None }))
            .map(move |item| -> Vec<Result<RecordBatch>> {
                if failed {
                    return vec![];
                }
                match item {
                    Some(Ok(b)) if holding => {
                        if skipped() > 0 {
                            (failed, holding) = (true, false);
                            held.clear();
                            return vec![Err(does_not_shrink(fraction))];
                        }
                        bytes += b.get_array_memory_size();
                        held.push(b);
                        if bytes <= HOLD_AT_MOST {
                            return vec![];
                        }
                        holding = false;
                        held.drain(..).map(Ok).collect()
                    }
                    Some(Err(e)) => {
                        (failed, holding) = (true, false);
                        held.clear();
                        vec![Err(e)]
                    }
                    Some(b) => vec![b],
                    None => held.drain(..).map(Ok).collect(),
                }
            })
            .flat_map(futures::stream::iter);
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, checked)))
    }
}

/// The most of a partial aggregate's output [`ShrinkGuardExec`] holds back (per
/// stream, outside the memory pool) while it waits to see whether it skips.
const HOLD_AT_MOST: usize = 16 << 20;

fn does_not_shrink(fraction: f32) -> DataFusionError {
    DataFusionError::External(Box::new(Error::PushedBack(PushBack {
        reason: format!(
            "the aggregate does not shrink here: a stream's first rows held more than {:.0}% \
             groups per row; the Parquet read directly is smaller",
            100.0 * fraction
        ),
        predicted_delay_ms: 0.0,
        estimate_ms: 0.0,
        bytes: 0,
        cause: PushBackCause::Judgement,
    })))
}
