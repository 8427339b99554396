//! Where a distributed scan's work goes: how many tasks a stage with a
//! [`CsdScanExec`] asks for (one per endpoint, capped by the planner at the
//! workers), how its endpoints are split between them (endpoints of one storage node
//! kept together), and which worker runs each task (the one beside the storage node
//! its endpoints are on).

use std::collections::BTreeMap;
use std::sync::Arc;

use datafusion::common::Result;
use datafusion::physical_plan::ExecutionPlan;
use datafusion_distributed::{
    DesiredTaskCountEvent, DesiredTaskCountEventResponse, DistributedLeafExec, NetworkBoundaryExt,
    RouteTasksEvent, RouteTasksEventResponse, RouteTasksHandler, ScaleUpLeafNodeEvent,
    ScaleUpLeafNodeEventResponse,
};
use url::Url;

use crate::compute::scan::CsdScanExec;

/// One task per endpoint (partition on a node); the planner caps it at the number
/// of workers.
pub(crate) fn desired_tasks(
    ev: DesiredTaskCountEvent,
) -> Option<Result<DesiredTaskCountEventResponse>> {
    let scan = ev.plan.downcast_ref::<CsdScanExec>()?;
    Some(Ok(DesiredTaskCountEventResponse::desired(
        scan.table().endpoints().len().max(1),
    )))
}

/// Splits a scan's endpoints into `task_count` shares, each a scan of its own with
/// the same number of partitions (the longest share's; shorter ones answer empty
/// partitions). Endpoints are ordered by node first, so a node's partitions stay in
/// one share where they can (and that share's task goes beside the node).
pub(crate) fn scale_up(ev: ScaleUpLeafNodeEvent) -> Option<Result<ScaleUpLeafNodeEventResponse>> {
    let scan = ev.plan.downcast_ref::<CsdScanExec>()?;
    let shares = split(
        scan.table().endpoints().to_vec(),
        ev.task_count.max(1),
        |e| e.node,
    );
    let width = shares.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let variants = shares
        .into_iter()
        .map(|share| Arc::new(scan.with_endpoints(share, width)) as Arc<dyn ExecutionPlan>);
    Some(
        DistributedLeafExec::try_new(ev.plan.clone(), variants)
            .map(|leaf| ScaleUpLeafNodeEventResponse::new(Arc::new(leaf))),
    )
}

/// `items` (sorted by `node`, stable) in `n` contiguous shares whose lengths differ
/// by at most one.
fn split<T>(mut items: Vec<T>, n: usize, node: impl Fn(&T) -> usize) -> Vec<Vec<T>> {
    items.sort_by_key(|e| node(e));
    let (base, extra) = (items.len() / n, items.len() % n);
    let mut it = items.into_iter();
    (0..n)
        .map(|i| it.by_ref().take(base + usize::from(i < extra)).collect())
        .collect()
}

/// Sends each task of a stage that scans the storage nodes to the worker nearest
/// the node its share is on: the one `locality` names for that node, else one on
/// the same host, else the next in turn. Stages without a scan are left to the
/// planner's own routing.
#[derive(Debug, Clone)]
pub struct Placement {
    workers: Vec<Url>,
    locality: BTreeMap<String, Url>,
}

impl Placement {
    /// Over `workers`, with `locality` naming the worker of some nodes (node URL →
    /// worker URL).
    pub fn new(workers: Vec<Url>, locality: BTreeMap<String, Url>) -> Self {
        Placement { workers, locality }
    }

    /// The worker for a task whose share is on the node at `node` (the `i`th task).
    pub(crate) fn worker_for(&self, node: Option<&str>, i: usize) -> Option<Url> {
        if self.workers.is_empty() {
            return None;
        }
        if let Some(node) = node {
            if let Some(w) = self.locality.get(node) {
                return Some(w.clone());
            }
            let host = host_of(node);
            let near: Vec<&Url> = self
                .workers
                .iter()
                .filter(|w| host.is_some() && w.host_str() == host.as_deref())
                .collect();
            if !near.is_empty() {
                return Some(near[i % near.len()].clone());
            }
        }
        Some(self.workers[i % self.workers.len()].clone())
    }
}

/// The host of a node URL (`grpc://h:p`, `h:p`, …).
fn host_of(node: &str) -> Option<String> {
    let with_scheme = if node.contains("://") {
        node.to_string()
    } else {
        format!("grpc://{node}")
    };
    Url::parse(&with_scheme)
        .ok()?
        .host_str()
        .map(str::to_string)
}

/// The split scan of a stage (its head plan), not looking past the stage's network
/// boundaries (their inputs are other stages).
fn stage_scan(plan: &Arc<dyn ExecutionPlan>) -> Option<&DistributedLeafExec> {
    if let Some(leaf) = plan.downcast_ref::<DistributedLeafExec>()
        && leaf.original().downcast_ref::<CsdScanExec>().is_some()
    {
        return Some(leaf);
    }
    if plan.as_ref().is_network_boundary() {
        return None;
    }
    plan.children().into_iter().find_map(stage_scan)
}

impl RouteTasksHandler for Placement {
    fn handle(&self, ev: RouteTasksEvent) -> Option<Result<RouteTasksEventResponse>> {
        let leaf = stage_scan(ev.plan)?;
        let urls = (0..ev.task_count)
            .map(|i| {
                let node = leaf
                    .variants()
                    .get(i)
                    .and_then(|v| v.downcast_ref::<CsdScanExec>())
                    .and_then(|s| s.table().endpoints().first())
                    .map(|e| e.client.url().to_string());
                self.worker_for(node.as_deref(), i)
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Ok(RouteTasksEventResponse::new(urls)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_keep_a_nodes_partitions_together_and_differ_by_one_at_most() {
        let items = vec![(1, "a"), (0, "b"), (1, "c"), (0, "d"), (2, "e")];
        let node = |e: &(usize, &str)| e.0;
        let s = split(items.clone(), 2, node);
        assert_eq!(
            s,
            vec![vec![(0, "b"), (0, "d"), (1, "a")], vec![(1, "c"), (2, "e")]]
        );
        let s = split(items.clone(), 7, node);
        assert_eq!(s.len(), 7);
        assert_eq!(s.iter().map(Vec::len).sum::<usize>(), 5);
        assert!(s.iter().all(|v| v.len() <= 1));
        assert_eq!(split(items, 1, node)[0].len(), 5);
    }

    #[test]
    fn a_task_goes_to_the_named_worker_then_the_same_host_then_in_turn() {
        let w = |s: &str| Url::parse(s).unwrap();
        let p = Placement::new(
            vec![w("http://10.0.0.1:7000"), w("http://10.0.0.2:7000")],
            BTreeMap::from([(
                "grpc://10.0.0.9:5000".to_string(),
                w("http://10.0.0.1:7000"),
            )]),
        );
        assert_eq!(
            p.worker_for(Some("grpc://10.0.0.9:5000"), 1),
            Some(w("http://10.0.0.1:7000"))
        );
        assert_eq!(
            p.worker_for(Some("grpc://10.0.0.2:5000"), 0),
            Some(w("http://10.0.0.2:7000"))
        );
        assert_eq!(
            p.worker_for(Some("10.0.0.2:5000"), 3),
            Some(w("http://10.0.0.2:7000"))
        );
        assert_eq!(
            p.worker_for(Some("grpc://10.0.0.7:5000"), 3),
            Some(w("http://10.0.0.2:7000"))
        );
        assert_eq!(p.worker_for(None, 0), Some(w("http://10.0.0.1:7000")));
        assert_eq!(
            Placement::new(vec![], BTreeMap::new()).worker_for(None, 0),
            None
        );
    }
}
