//! A `datafusion-distributed` worker that runs csd plans: the session every task it
//! runs gets ([`worker_sessions`]: our codec, the coordinator's options, its
//! [`WorkerEnv`] for decoding scans), and the server ([`serve_worker_on`]) with its
//! own Flight service beside it (`service.rs`: the key board, modules sent to it).
//!
//! The worker's side only: it uses the planner (`compute`), and nothing there
//! imports it; the coordinator's side of the workers is `compute::distributed`.

mod service;

use std::sync::Arc;

use async_trait::async_trait;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::FunctionRegistry;
use datafusion::execution::SessionState;
use datafusion_distributed::{DistributedExt, Worker, WorkerQueryContext, WorkerSessionBuilder};

use crate::compute::distributed::codec::CsdCodec;
use crate::compute::distributed::env::WorkerEnv;
use crate::compute::distributed::scope::DecodeScope;
use crate::compute::median_weighted::median_weighted_udaf;
use crate::compute::sandbox::worker_function;
use crate::eval::scan;
use crate::options::CsdOptions;
use service::WorkerActions;

impl WorkerEnv {
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
        state.register_udaf(median_weighted_udaf())?;
        for f in functions.iter() {
            state.register_udf(Arc::new(worker_function(f).await?))?;
        }
        Ok(state)
    }
}

/// Serves `env`'s worker (and its own service beside it, see [`super::service`])
/// on `listener` until `shutdown` resolves.
pub async fn serve_worker_on(
    env: Arc<WorkerEnv>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let incoming = csd_protocol::tcp::incoming(listener);
    tonic::transport::Server::builder()
        .add_service(env.worker().into_worker_server())
        .add_service(WorkerActions(env.board.clone()).into_server())
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .map_err(|e| DataFusionError::External(Box::new(e)))
}
