//! Configuration and start-up of a whole storage node.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use arrow_flight::flight_service_server::FlightServiceServer;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::admission::{Admission, AdmissionConfig, Policy, parse_tenant};
use crate::device::{DeviceSpec, parse_size};
use crate::error::{Error, Result};
use crate::operator::OperatorRegistry;
use crate::pool::CpuPool;
use crate::service::{FlightNode, NodeState};
use crate::store::{FormatMode, ObjectStore, StoreOptions};
use crate::table::{ParquetOptions, TableStore};

/// Largest gRPC message the node accepts or sends.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// A node's configuration (`csd serve` flags, or a TOML file with the same keys).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeConfig {
    /// Device spec: a file or raw device path (io_uring), or `emulated:...`.
    pub device: String,
    /// Capacity for new device files and emulated devices (`64GiB`).
    pub capacity: Option<String>,
    /// Address to listen on (`127.0.0.1:0` picks a free port).
    pub listen: String,
    /// Location advertised to clients; default `grpc://<bound address>`.
    pub advertise: Option<String>,
    /// CPU pool size for operator work.
    pub cpus: usize,
    /// Cores the operator workers are pinned to (`0-3,6`, as `taskset -c` takes);
    /// default: unpinned.
    pub cpu_set: Option<String>,
    /// Memory budget (`2GiB`).
    pub memory: String,
    /// Erase and format the device at start.
    pub format: bool,
    /// How tables are written.
    pub parquet: ParquetOptions,
    /// Admission policy: `adaptive` (default), `always` (run everything pushed
    /// down, queueing), `never` (push every operator back).
    pub policy: Policy,
    /// Queueing-delay target in milliseconds: a request predicted to wait longer is
    /// pushed back.
    pub queue_target_ms: f64,
    /// Tenants as `name=weight[:reserved slots]`; others get weight 1.
    pub tenants: Vec<String>,
    /// Serve Prometheus metrics over HTTP here (`127.0.0.1:9090`).
    pub metrics_listen: Option<String>,
    /// Raw reads served at once.
    pub read_slots: usize,
    /// Raw reads that may wait; beyond, `RESOURCE_EXHAUSTED` with a retry hint.
    pub read_queue: usize,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            device: "csd-device.img".into(),
            capacity: Some("4GiB".into()),
            listen: "127.0.0.1:50051".into(),
            advertise: None,
            cpus: 2,
            cpu_set: None,
            memory: "2GiB".into(),
            format: false,
            parquet: ParquetOptions::default(),
            policy: Policy::Adaptive,
            queue_target_ms: 50.0,
            tenants: Vec::new(),
            metrics_listen: None,
            read_slots: 64,
            read_queue: 4096,
        }
    }
}

impl NodeConfig {
    /// Reads a TOML file; unknown keys and bad values are errors naming the key.
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        toml::from_str(&text)
            .map_err(|e| Error::InvalidArgument(format!("{}: {e}", path.display())))
    }

    /// The admission settings these flags describe, for `cpus` workers and
    /// `memory` bytes.
    pub fn admission(&self, memory: u64) -> Result<AdmissionConfig> {
        let mut a = AdmissionConfig::new(self.cpus, memory);
        a.policy = self.policy;
        if self.read_slots == 0 {
            return Err(Error::InvalidArgument(
                "read slots must be at least 1".into(),
            ));
        }
        a.io_in_flight = self.read_slots;
        a.io_queue = self.read_queue;
        if !(self.queue_target_ms.is_finite() && self.queue_target_ms >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "queue target {} ms must be a non-negative number",
                self.queue_target_ms
            )));
        }
        a.queue_target = std::time::Duration::from_secs_f64(self.queue_target_ms / 1e3);
        for t in &self.tenants {
            let (name, share) = parse_tenant(t).map_err(Error::InvalidArgument)?;
            a.tenants.insert(name, share);
        }
        let reserved: usize = a.tenants.values().map(|t| t.reserve).sum();
        if reserved > a.slots {
            return Err(Error::InvalidArgument(format!(
                "tenants reserve {reserved} slots but the node has {} CPU workers",
                a.slots
            )));
        }
        Ok(a)
    }
}

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
    let capacity = config.capacity.as_deref().map(parse_size).transpose()?;
    let memory_budget = parse_size(&config.memory)?;
    let admission = config.admission(memory_budget)?;
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
            .with_admission(Admission::new(admission)),
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
            .initial_stream_window_size(crate::client::STREAM_WINDOW)
            .initial_connection_window_size(crate::client::CONNECTION_WINDOW)
            .add_service(service)
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stopped.await;
            })
            .await
            .map_err(|e| Error::External(format!("gRPC server: {e}")))
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
