//! What a worker process keeps across the queries it runs ([`WorkerEnv`]): its own
//! connections to the storage nodes, made with its own credentials, its byte-range
//! store, its local gate and its key board.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use csd_protocol::node_client::{Credentials, NodeClient};
use datafusion::common::Result;
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};

use super::keys::KeyBoard;
use crate::compute::gate::LocalGate;
use crate::compute::range_read::{CLUSTER_URL, NodeRangeStore};
use crate::error::to_datafusion;

/// What a worker process keeps across the queries it runs: one connection per
/// storage node (made when a plan first names the node, with the worker's own
/// credentials), the byte-range store fragments handed back read through, and the
/// gate they run under here.
pub struct WorkerEnv {
    credentials: Credentials,
    nodes: Mutex<HashMap<String, (NodeClient, usize)>>,
    ranges: Arc<NodeRangeStore>,
    local: Arc<LocalGate>,
    pub(crate) runtime: Arc<RuntimeEnv>,
    pub(crate) board: Arc<KeyBoard>,
}

impl std::fmt::Debug for WorkerEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerEnv")
            .field("credentials", &self.credentials)
            .field("ranges", &self.ranges)
            .finish()
    }
}

impl WorkerEnv {
    /// A worker that connects to storage nodes with `credentials` (token, TLS) and
    /// evaluates at most `local_slots` handed-back fragments at once (default: its
    /// cores).
    pub fn new(credentials: Credentials, local_slots: Option<usize>) -> Result<Arc<Self>> {
        let ranges = Arc::new(NodeRangeStore::new(vec![], &[]));
        let runtime = RuntimeEnvBuilder::new().build_arc()?;
        let url = ObjectStoreUrl::parse(CLUSTER_URL)?;
        runtime.register_object_store(url.as_ref(), ranges.clone());
        Ok(Arc::new(WorkerEnv {
            credentials,
            nodes: Mutex::new(HashMap::new()),
            ranges,
            local: local_slots.map_or_else(LocalGate::per_core, LocalGate::new),
            runtime,
            board: Arc::new(KeyBoard::default()),
        }))
    }

    /// Connects to `urls` now (a worker started with `--node`: an unreachable node
    /// is reported at start-up rather than by the first query).
    pub async fn connect(&self, urls: &[String]) -> Result<()> {
        for url in urls {
            let client = NodeClient::connect_with(url, &self.credentials)
                .await
                .map_err(to_datafusion)?;
            let mut nodes = self.lock();
            if !nodes.contains_key(url) {
                let i = self.ranges.add_node(client.clone());
                nodes.insert(url.clone(), (client, i));
            }
        }
        Ok(())
    }

    /// The storage nodes this worker has connections to.
    pub fn nodes(&self) -> Vec<String> {
        let mut v: Vec<String> = self.lock().keys().cloned().collect();
        v.sort();
        v
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (NodeClient, usize)>> {
        self.nodes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The client of the node at `url` and its index in the byte-range store,
    /// connecting (lazily) the first time.
    pub(crate) fn node(&self, url: &str) -> Result<(NodeClient, usize)> {
        let mut nodes = self.lock();
        if let Some(n) = nodes.get(url) {
            return Ok(n.clone());
        }
        let client =
            NodeClient::connect_lazy_with(url, &self.credentials).map_err(to_datafusion)?;
        let i = self.ranges.add_node(client.clone());
        nodes.insert(url.to_string(), (client.clone(), i));
        Ok((client, i))
    }

    pub(crate) fn ranges(&self) -> &Arc<NodeRangeStore> {
        &self.ranges
    }

    pub(crate) fn local(&self) -> &Arc<LocalGate> {
        &self.local
    }
}
