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
//!
//! A collector that still ends up in another stage than a scan it filters (a
//! partitioned join: its build and probe sides both behind shuffles) is given a
//! place where its keys meet ([`RemoteKeys`]): a set on one worker's key board,
//! named for this query, to which the collector's tasks publish and from which the
//! scan's tasks fetch (see [`super::keys`]).

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::common::Result;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::execution::context::QueryPlanner;
use datafusion::logical_expr::LogicalPlan;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::{ChildrenPropertiesMode, ExecutionPlan, ReplaceChildrenOptions};
use datafusion_distributed::{
    BroadcastExec, DistributedLeafExec, NetworkBoundaryExt, NetworkBroadcastExec,
};
use url::Url;

use super::keys::FlightKeyBoard;
use crate::compute::key_collector::{KeyCollectExec, KeyCollector, RemoteKeys};
use crate::compute::scan::CsdScanExec;

/// Plans with `inner` (the distributed planner), then lifts key collectors out of
/// broadcast stages.
#[derive(Debug)]
pub(crate) struct LiftKeyCollectors {
    pub(crate) inner: Arc<dyn QueryPlanner + Send + Sync>,
    /// The workers, whose key boards hold the keys that cross stages.
    pub(crate) workers: Vec<Url>,
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
        let plan = lift(plan)?;
        meet_across_stages(&plan, &self.workers);
        Ok(plan)
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

/// Gives each collector that runs in another stage than a scan it filters a set on
/// one of `workers`' key boards (see the module docs). A collector found in more
/// than one stage is left alone: its scans run without its filter.
pub(crate) fn meet_across_stages(plan: &Arc<dyn ExecutionPlan>, workers: &[Url]) {
    #[derive(Default)]
    struct Seen {
        collectors: HashMap<u64, Vec<usize>>,
        scans: Vec<(usize, Arc<KeyCollector>)>,
        stages: usize,
    }
    fn walk(plan: &Arc<dyn ExecutionPlan>, stage: usize, seen: &mut Seen) {
        if let Some(k) = plan.downcast_ref::<KeyCollectExec>() {
            let stages = seen.collectors.entry(k.collector().id()).or_default();
            if !stages.contains(&stage) {
                stages.push(stage);
            }
        }
        // A scan split among a stage's tasks sits in a leaf holding its per-task
        // variants (which share its collectors).
        let leaves = match plan.downcast_ref::<DistributedLeafExec>() {
            Some(leaf) => std::iter::once(leaf.original())
                .chain(leaf.variants())
                .collect(),
            None => vec![plan],
        };
        for s in leaves
            .iter()
            .filter_map(|p| p.downcast_ref::<CsdScanExec>())
        {
            for c in s.key_collectors() {
                seen.scans.push((stage, c.clone()));
            }
        }
        let boundary = plan.as_ref().is_network_boundary();
        for child in plan.children() {
            let stage = if boundary {
                seen.stages += 1;
                seen.stages
            } else {
                stage
            };
            walk(child, stage, seen);
        }
    }
    if workers.is_empty() {
        return;
    }
    let mut seen = Seen::default();
    walk(plan, 0, &mut seen);
    // Names unique to this planned query: collector ids are only unique within
    // one process.
    let nonce = RandomState::new().hash_one(std::time::SystemTime::now());
    for (stage, c) in seen.scans {
        match seen.collectors.get(&c.id()).map(Vec::as_slice) {
            Some(&[at]) if at != stage && c.remote().is_none() => {
                let home = &workers[(c.id() as usize) % workers.len()];
                c.set_remote(
                    RemoteKeys {
                        home: home.as_str().trim_end_matches('/').to_string(),
                        key: format!("{nonce:016x}/{}", c.id()),
                        wait_ms: c.wait_for().as_millis() as u64,
                    },
                    Arc::new(FlightKeyBoard),
                );
            }
            _ => {}
        }
    }
}
