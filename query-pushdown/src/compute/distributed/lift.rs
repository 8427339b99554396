//! Keeps join-key filters working across a broadcast join's stage boundary.
//!
//! `KeyFilterRule` wraps a hash join's build side in a [`KeyCollectExec`]; the
//! distributed planner then broadcasts that whole build side, so the collector ends
//! up in the producer stage (`BroadcastExec(KeyCollectExec(…))`) while the scan that
//! waits for its keys runs in the consumer stage, on other workers: the filter would
//! be lost. [`LiftKeyCollectors`] moves the collector above the broadcast's consumer
//! (`KeyCollectExec(CoalescePartitionsExec(NetworkBroadcastExec(BroadcastExec(…))))`),
//! into the stage of the join and its probe-side scan; each task then collects the
//! whole broadcast build side, as the join itself does.

use std::sync::Arc;

use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::common::Result;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::execution::context::QueryPlanner;
use datafusion::logical_expr::LogicalPlan;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::{ChildrenPropertiesMode, ExecutionPlan, ReplaceChildrenOptions};
use datafusion_distributed::{BroadcastExec, NetworkBroadcastExec};

use crate::compute::key_collector::KeyCollectExec;

/// Plans with `inner` (the distributed planner), then lifts key collectors out of
/// broadcast stages.
#[derive(Debug)]
pub(crate) struct LiftKeyCollectors {
    pub(crate) inner: Arc<dyn QueryPlanner + Send + Sync>,
}

#[async_trait]
impl QueryPlanner for LiftKeyCollectors {
    async fn create_physical_plan(
        &self,
        logical_plan: &LogicalPlan,
        session: &dyn Session,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let plan = self
            .inner
            .create_physical_plan(logical_plan, session)
            .await?;
        lift(plan)
    }
}

/// See the module docs.
pub(crate) fn lift(plan: Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    plan.transform_up(|node| {
        let Some(coalesce) = node.downcast_ref::<CoalescePartitionsExec>() else {
            return Ok(Transformed::no(node));
        };
        let network = coalesce.input();
        if !network.is::<NetworkBroadcastExec>() {
            return Ok(Transformed::no(node));
        }
        let [stage] = network.children()[..] else {
            return Ok(Transformed::no(node));
        };
        let Some(broadcast) = stage.downcast_ref::<BroadcastExec>() else {
            return Ok(Transformed::no(node));
        };
        let Some(collect) = broadcast.input().downcast_ref::<KeyCollectExec>() else {
            return Ok(Transformed::no(node));
        };
        let stage = recompute(stage.clone(), collect.input().clone())?;
        let network = recompute(network.clone(), stage)?;
        let coalesce = recompute(node.clone(), network)?;
        Ok(Transformed::yes(Arc::new(KeyCollectExec::new(
            coalesce,
            collect.collector().clone(),
        ))))
    })
    .map(|t| t.data)
}

fn recompute(
    plan: Arc<dyn ExecutionPlan>,
    child: Arc<dyn ExecutionPlan>,
) -> Result<Arc<dyn ExecutionPlan>> {
    plan.replace_children(
        vec![child],
        ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute),
    )
}
