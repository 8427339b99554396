//! The compute tier on many machines, with `datafusion-distributed`: the session
//! that plans a query (the coordinator) cuts its physical plan into stages at
//! shuffles and broadcasts, and sends each stage's tasks to workers (`csd worker`),
//! which run them and stream Arrow to each other and back.
//!
//! A [`CsdScanExec`](crate::compute::scan::CsdScanExec) is a leaf like a file scan:
//! its endpoints (one partition of a table on one storage node) are split among the
//! stage's tasks, a node's endpoints kept together ([`placement`]); each task goes
//! to the worker beside the node its share is on ([`Placement`]); the scan travels
//! with its pushed fragment, estimates, join-key filter links and Wasm functions
//! ([`CsdCodec`]). On the worker the scan runs exactly as in one process: pushed to
//! the nodes, handed back and evaluated here under the worker's own [`LocalGate`],
//! patient requests, join-key filters (a broadcast join's build side is collected
//! in the join's stage, see `lift`; a build side in another stage, behind a
//! shuffle, publishes its keys to a board on one worker, from which the scan's tasks
//! fetch them: [`keys`]).
//!
//! This is the coordinator's side (and what both sides share: the codec, the
//! worker's environment, the decoding scope, the key board's messages); the
//! worker's own session and server are `crate::worker`, which uses this and is
//! never used by it.
//!
//! Credentials never travel in a plan: a worker reaches the storage nodes with its
//! own (`csd worker --token/--tls-*`, as every client), so it must hold a token the
//! nodes accept for the tables its tasks read.
//!
//! [`LocalGate`]: crate::compute::gate::LocalGate

pub(crate) mod actions;
pub(crate) mod codec;
pub(crate) mod env;
pub(crate) mod keys;
mod lift;
pub(crate) mod placement;
pub(crate) mod scope;

use std::collections::BTreeMap;
use std::sync::Arc;

use datafusion::common::{DataFusionError, Result};
use datafusion::execution::SessionStateBuilder;
use datafusion_distributed::{DistributedExt, SessionStateBuilderExt, WorkerResolver};
use url::Url;

pub use codec::CsdCodec;
pub use env::WorkerEnv;
pub use placement::Placement;

use crate::options::CsdOptions;

/// Where a session's stages run: worker URLs (`http://host:port`, `grpc://host:port`
/// or `host:port`) and, optionally, which worker is nearest each storage node (node
/// URL → worker URL; without it, a worker on the node's host is nearest).
#[derive(Debug, Clone, Default)]
pub struct Workers {
    /// Worker URLs.
    pub urls: Vec<String>,
    /// Node URL → worker URL.
    pub locality: BTreeMap<String, String>,
}

impl Workers {
    /// Workers at `urls`, nearest by host.
    pub fn new(urls: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Workers {
            urls: urls.into_iter().map(Into::into).collect(),
            locality: BTreeMap::new(),
        }
    }

    /// The workers' URLs as the engine dials them, and the locality map.
    fn resolve(&self) -> Result<(Vec<Url>, BTreeMap<String, Url>)> {
        if self.urls.is_empty() {
            return Err(DataFusionError::Plan("no workers given".into()));
        }
        let urls = self
            .urls
            .iter()
            .map(|u| worker_url(u))
            .collect::<Result<Vec<_>>>()?;
        let mut locality = BTreeMap::new();
        for (node, w) in &self.locality {
            let w = worker_url(w)?;
            if !urls.contains(&w) {
                return Err(DataFusionError::Plan(format!(
                    "the locality map names worker {w} for node {node}, which is not among the workers"
                )));
            }
            locality.insert(node.clone(), w);
        }
        Ok((urls, locality))
    }

    /// `builder` (with its query planner already set) planning distributed over
    /// these workers.
    pub(crate) fn configure(
        &self,
        builder: SessionStateBuilder,
        options: CsdOptions,
    ) -> Result<SessionStateBuilder> {
        let (urls, locality) = self.resolve()?;
        let mut builder = builder
            .with_distributed_worker_resolver(StaticWorkers(urls.clone()))
            .with_distributed_planner();
        if let Some(inner) = builder.query_planner().take() {
            builder = builder.with_query_planner(Arc::new(lift::LiftKeyCollectors {
                inner,
                workers: urls.clone(),
            }));
        }
        Ok(builder
            .with_distributed_user_codec(CsdCodec)
            .with_distributed_option_extension(options)
            .with_distributed_desired_task_count_handler(placement::desired_tasks)
            .with_distributed_scale_up_leaf_node_handler(placement::scale_up)
            .with_distributed_route_tasks_handler(Placement::new(urls, locality)))
    }
}

/// `http://host:port` for `grpc://host:port`, `http://host:port` or `host:port`.
pub(crate) fn worker_url(u: &str) -> Result<Url> {
    let s = match u.split_once("://") {
        Some(("grpc" | "http", rest)) => format!("http://{rest}"),
        Some((scheme, _)) => {
            return Err(DataFusionError::Plan(format!(
                "worker URL {u:?}: scheme {scheme} is not grpc or http (workers are reached over plain gRPC)"
            )));
        }
        None => format!("http://{u}"),
    };
    let url =
        Url::parse(&s).map_err(|e| DataFusionError::Plan(format!("worker URL {u:?}: {e}")))?;
    if url.host_str().is_none() || url.port_or_known_default().is_none() {
        return Err(DataFusionError::Plan(format!(
            "worker URL {u:?} names no host and port"
        )));
    }
    Ok(url)
}

/// A fixed list of workers.
struct StaticWorkers(Vec<Url>);

impl WorkerResolver for StaticWorkers {
    fn get_urls(&self) -> Result<Vec<Url>> {
        Ok(self.0.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_urls_are_read_like_node_urls() {
        assert_eq!(worker_url("grpc://h:1").unwrap().as_str(), "http://h:1/");
        assert_eq!(worker_url("h:2").unwrap().as_str(), "http://h:2/");
        assert_eq!(worker_url("http://h:3").unwrap().as_str(), "http://h:3/");
        let e = worker_url("https://h:4").unwrap_err().to_string();
        assert!(e.contains("scheme https"), "{e}");
        let w = Workers {
            urls: vec!["h:1".into()],
            locality: BTreeMap::from([("grpc://n:5".into(), "h:9".into())]),
        };
        let e = w.resolve().unwrap_err().to_string();
        assert!(e.contains("not among the workers"), "{e}");
        assert!(Workers::default().resolve().is_err());
    }
}
