//! Configuration and start-up of a whole storage node.

use std::net::SocketAddr;
use std::sync::Arc;

use arrow_flight::flight_service_server::FlightServiceServer;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::admission::Admission;
use crate::config::NodeConfig;
use crate::device::DeviceSpec;
use crate::error::{Error, Result, StatusCode};
use crate::operator::OperatorRegistry;
use crate::pool::CpuPool;
use crate::protocol::{CONNECTION_WINDOW, MAX_MESSAGE_BYTES, STREAM_WINDOW};
use crate::service::FlightNode;
use crate::state::NodeState;
use crate::store::{FormatMode, ObjectStore, StoreOptions};
use crate::table::TableStore;

/// A running node. Shut it down with [`RunningNode::shutdown`].
pub struct RunningNode {
    /// The bound address.
    pub addr: SocketAddr,
    /// The URL clients use.
    pub url: String,
    /// Shared state (tables, pool, counters).
    pub state: Arc<NodeState>,
    /// Where Prometheus metrics are served, with `metrics_listen`.
    pub metrics_addr: Option<SocketAddr>,
    metrics_task: Option<JoinHandle<()>>,
    stop: Option<oneshot::Sender<()>>,
    server: JoinHandle<Result<()>>,
}

impl RunningNode {
    /// Stops accepting, finishes in-flight calls, and waits.
    pub async fn shutdown(mut self) -> Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.metrics_task.take() {
            t.abort();
        }
        (&mut self.server)
            .await
            .map_err(|e| Error::Internal(format!("server task: {e}")))?
    }

    /// Waits until the server stops by itself (an error, or a shutdown elsewhere).
    pub async fn wait(&mut self) -> Result<()> {
        (&mut self.server)
            .await
            .map_err(|e| Error::Internal(format!("server task: {e}")))?
    }
}

impl Drop for RunningNode {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.metrics_task.take() {
            t.abort();
        }
    }
}

/// Opens device, store and tables, binds the listener and starts serving (raw scans
/// and ranges only; see [`start_with`] for pushed-down operators).
pub async fn start(config: &NodeConfig) -> Result<RunningNode> {
    start_with(config, OperatorRegistry::new()).await
}

/// [`start`], serving `operators` too.
pub async fn start_with(config: &NodeConfig, operators: OperatorRegistry) -> Result<RunningNode> {
    let spec: DeviceSpec = config.device.parse()?;
    let capacity = Some(config.capacity.bytes());
    let memory_budget = config.memory.bytes();
    let admission = config.admission()?;
    let dev = tokio::task::spawn_blocking({
        let spec = spec.clone();
        move || spec.open(capacity)
    })
    .await
    .map_err(|e| Error::Internal(e.to_string()))??;
    let opts = StoreOptions {
        format: if config.format {
            FormatMode::Force
        } else {
            FormatMode::IfBlank
        },
        ..Default::default()
    };
    let store = ObjectStore::open(dev, opts).await?;
    let tables = TableStore::open(store, &config.parquet).await?;
    let cores = config
        .cpu_set
        .as_deref()
        .map(crate::pool::parse_core_list)
        .transpose()?;
    let pool = CpuPool::pinned(config.cpus, cores)?;
    let listener = TcpListener::bind(&config.listen)
        .await
        .map_err(|e| Error::io(format!("binding {}", config.listen), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::io("reading the bound address", e))?;
    let url = config
        .advertise
        .clone()
        .unwrap_or_else(|| format!("grpc://{addr}"));
    let state = Arc::new(
        NodeState::new(tables, pool, url.clone(), memory_budget)
            .with_operators(operators)
            .with_admission(Admission::new(admission))
            .with_wire(config.range_chunk.bytes(), config.wire_piece.bytes()),
    );
    let (metrics_addr, metrics_task) = match &config.metrics_listen {
        Some(addr) => {
            let (a, t) = crate::metrics::serve(addr, state.clone()).await?;
            (Some(a), Some(t))
        }
        None => (None, None),
    };
    let service = FlightServiceServer::new(FlightNode::new(state.clone()))
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let (stop, stopped) = oneshot::channel::<()>();
    // Without TCP_NODELAY a small write after a large one (an answer's gRPC trailers,
    // a short range) waits for the peer's delayed ACK, up to 40 ms per request on a
    // quiet connection. `serve_with_incoming` does not set it, so set it here.
    let incoming = tokio_stream::StreamExt::map(
        tokio_stream::wrappers::TcpListenerStream::new(listener),
        |conn| {
            if let Ok(c) = &conn
                && let Err(e) = c.set_nodelay(true)
            {
                tracing::warn!("TCP_NODELAY on an accepted connection: {e}");
            }
            conn
        },
    );
    let server = tokio::spawn(async move {
        tonic::transport::Server::builder()
            // The same windows as the client's, for uploads.
            .initial_stream_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .add_service(service)
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stopped.await;
            })
            .await
            .map_err(|e| Error::external(StatusCode::Internal, "gRPC server", e))
    });
    tracing::info!(%url, device = %spec, "storage node serving");
    Ok(RunningNode {
        addr,
        url,
        state,
        metrics_addr,
        metrics_task,
        stop: Some(stop),
        server,
    })
}
