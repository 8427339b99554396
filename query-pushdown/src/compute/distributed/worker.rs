//! A `datafusion-distributed` worker that runs csd plans: [`WorkerEnv`] (its own
//! connections to the storage nodes, made with its own credentials, its byte-range
//! store and its local gate) and the session every task it runs gets
//! ([`worker_sessions`]).

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use csd_runtime::node_client::{Credentials, NodeClient};
use csd_runtime::sandbox::ModuleDigest;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::FunctionRegistry;
use datafusion::execution::SessionState;
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};
use datafusion::logical_expr::ScalarUDF;
use datafusion_distributed::{DistributedExt, Worker, WorkerQueryContext, WorkerSessionBuilder};

use super::codec::{CsdCodec, DecodeScope};
use super::keys::KeyBoard;
use super::service::WorkerActions;
use crate::compute::gate::LocalGate;
use crate::compute::range_read::{CLUSTER_URL, NodeRangeStore};
use crate::compute::wasm::local_sandbox;
use crate::error::to_datafusion;
use crate::eval::scan;
use crate::eval::wasm_fn::{ShippedFunction, WasmScalarUdf};
use crate::options::CsdOptions;

/// What a worker process keeps across the queries it runs: one connection per
/// storage node (made when a plan first names the node, with the worker's own
/// credentials), the byte-range store fragments handed back read through, and the
/// gate they run under here.
pub struct WorkerEnv {
    credentials: Credentials,
    nodes: Mutex<HashMap<String, (NodeClient, usize)>>,
    ranges: Arc<NodeRangeStore>,
    local: Arc<LocalGate>,
    runtime: Arc<RuntimeEnv>,
    board: Arc<KeyBoard>,
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

    /// The worker service (a tonic service to serve).
    pub fn worker(self: &Arc<Self>) -> Worker {
        Worker::from_session_builder(worker_sessions(self.clone()))
            .with_runtime_env(self.runtime.clone())
    }
}

/// The session every task a worker runs gets: our codec, the coordinator's `csd.*`
/// options, the scan settings of [`crate::Cluster::session`], and `env`'s
/// connections for decoding scans.
pub fn worker_sessions(env: Arc<WorkerEnv>) -> WorkerSessions {
    WorkerSessions { env }
}

/// See [`worker_sessions`].
#[derive(Debug, Clone)]
pub struct WorkerSessions {
    env: Arc<WorkerEnv>,
}

#[async_trait]
impl WorkerSessionBuilder for WorkerSessions {
    async fn build_session_state(
        &self,
        ctx: WorkerQueryContext,
    ) -> Result<SessionState, DataFusionError> {
        let mut b = ctx
            .builder
            .with_distributed_user_codec(CsdCodec)
            .with_distributed_option_extension_from_headers::<CsdOptions>(&ctx.headers)?;
        let config = b.config().take().unwrap_or_default();
        let functions = config
            .options()
            .extensions
            .get::<CsdOptions>()
            .map(|o| o.wasm_functions.clone())
            .unwrap_or_default();
        let config =
            scan::configure(config).with_extension(Arc::new(DecodeScope::new(self.env.clone())));
        *b.config() = Some(config);
        let mut state = b.build();
        for f in functions.split(';').filter(|f| !f.is_empty()) {
            state.register_udf(Arc::new(wasm_function(f).await?))?;
        }
        Ok(state)
    }
}

/// The session's Wasm function `entry` (`NAME=DIGEST:EXPORT`, see
/// [`CsdOptions`]), from the module the coordinator sent this worker.
async fn wasm_function(entry: &str) -> Result<ScalarUDF> {
    let bad = || {
        DataFusionError::Plan(format!(
            "csd.wasm_functions entry {entry:?}: write NAME=DIGEST:EXPORT"
        ))
    };
    let (name, rest) = entry.split_once('=').ok_or_else(bad)?;
    let (digest, export) = rest.split_once(':').ok_or_else(bad)?;
    let digest = ModuleDigest::parse(digest.as_bytes()).map_err(|_| bad())?;
    let sandbox = local_sandbox()?;
    let module = sandbox.module(&digest, None).await.map_err(|e| {
        DataFusionError::Plan(format!(
            "wasm function {name}: this worker does not have module {digest} ({e}); \
             register the function on the session again to send it"
        ))
    })?;
    let shipped = ShippedFunction {
        name: name.to_string(),
        export: export.to_string(),
        digest,
        bytes: None,
    };
    let udf = WasmScalarUdf::load(sandbox, module, shipped, Arc::new(AtomicBool::new(false)))
        .map_err(|e| DataFusionError::External(Box::new(e)))?;
    Ok(ScalarUDF::new_from_impl(udf))
}

/// Serves `env`'s worker (and its own service beside it, see [`super::service`])
/// on `listener` until `shutdown` resolves.
pub async fn serve_worker_on(
    env: Arc<WorkerEnv>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .add_service(env.worker().into_worker_server())
        .add_service(WorkerActions(env.board.clone()).into_server())
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .map_err(|e| DataFusionError::External(Box::new(e)))
}
