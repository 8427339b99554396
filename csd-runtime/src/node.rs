//! Configuration and start-up of a whole storage node.

use std::net::SocketAddr;
use std::sync::Arc;

use arrow_flight::flight_service_server::FlightServiceServer;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::auth::{Auth, TICKET_KEY_OBJECT, TicketKey};
use crate::config::NodeConfig;
use crate::error::{Error, Result, StatusCode};
use crate::operator::OperatorRegistry;
use crate::pool::CpuPool;
use crate::protocol::{CONNECTION_WINDOW, MAX_MESSAGE_BYTES, STREAM_WINDOW};
use crate::service::FlightNode;
use crate::settings::{NodeSettings, TlsFiles};
use crate::state::{NodeParts, NodeState};
use crate::store::{ObjectStore, StoreOptions};
use crate::table::TableStore;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};

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
    /// The node's own tasks beside the server (metrics, SIGHUP, sweeps, scrub):
    /// stopped with it.
    background: Vec<JoinHandle<()>>,
    stop: Option<oneshot::Sender<()>>,
    server: JoinHandle<Result<()>>,
}

impl RunningNode {
    /// Stops accepting, finishes in-flight calls, and waits.
    pub async fn shutdown(mut self) -> Result<()> {
        self.stop_background();
        (&mut self.server)
            .await
            .map_err(|e| Error::external(StatusCode::Internal, "the server task", e))?
    }

    /// Waits until the server stops by itself (an error, or a shutdown elsewhere).
    pub async fn wait(&mut self) -> Result<()> {
        (&mut self.server)
            .await
            .map_err(|e| Error::external(StatusCode::Internal, "the server task", e))?
    }

    /// Tells the server to stop and ends the background tasks.
    fn stop_background(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        for t in self.background.drain(..) {
            t.abort();
        }
    }
}

impl Drop for RunningNode {
    fn drop(&mut self) {
        self.stop_background();
    }
}

impl RunningNode {
    /// Re-reads the tenants file (what `SIGHUP` does): new tokens, permissions,
    /// shares and quotas apply to the next request; connections stay open. On an
    /// error the old tenants stay.
    pub fn reload_auth(&self) -> Result<usize> {
        reload(&self.state)
    }
}

fn reload(state: &NodeState) -> Result<usize> {
    let n = state.auth.reload()?;
    state.admission.set_tenants(state.auth.shares())?;
    Ok(n)
}

/// The node's ticket key: from `--ticket-key`, else (with tenants) kept on the device,
/// made once; a node without tenants seals nothing and keeps a key in memory only.
async fn ticket_key(
    settings: &NodeSettings,
    store: &ObjectStore,
    auth: &Auth,
) -> Result<TicketKey> {
    if let Some(path) = &settings.ticket_key {
        return TicketKey::from_file(path);
    }
    if !auth.enabled() {
        return Ok(TicketKey::random());
    }
    if store.get(TICKET_KEY_OBJECT).is_some() {
        return TicketKey::from_bytes(&store.get_all(TICKET_KEY_OBJECT).await?);
    }
    let key = TicketKey::random();
    store.put(TICKET_KEY_OBJECT, key.bytes()).await?;
    Ok(key)
}

fn read_pem(path: &std::path::Path, what: &str) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::io(format!("reading the {what} {}", path.display()), e))
}

/// The Flight port's TLS from its files.
fn tls_config(files: &TlsFiles) -> Result<ServerTlsConfig> {
    let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(
        read_pem(&files.cert, "TLS certificate")?,
        read_pem(&files.key, "TLS key")?,
    ));
    if let Some(ca) = &files.client_ca {
        tls = tls.client_ca_root(Certificate::from_pem(read_pem(ca, "client CA")?));
    }
    Ok(tls)
}

/// Opens device, store and tables, binds the listener and starts serving (raw scans
/// and ranges only; see [`start_with`] for pushed-down operators).
pub async fn start(config: &NodeConfig) -> Result<RunningNode> {
    start_with(config, OperatorRegistry::new()).await
}

/// [`start`], serving `operators` too.
pub async fn start_with(config: &NodeConfig, operators: OperatorRegistry) -> Result<RunningNode> {
    let settings = config.settings()?;
    let dev = tokio::task::spawn_blocking({
        let (spec, capacity) = (settings.device.clone(), settings.capacity);
        move || spec.open(Some(capacity))
    })
    .await
    .map_err(|e| Error::external(StatusCode::Internal, "opening the device", e))??;
    let opts = StoreOptions {
        format: settings.format,
        ..Default::default()
    };
    let store = ObjectStore::open(dev, opts).await?;
    let tls = settings.tls.as_ref().map(tls_config).transpose()?;
    let auth = Arc::new(match &settings.auth {
        Some(path) => Auth::from_file(path)?,
        None => Auth::open(),
    });
    let key = ticket_key(&settings, &store, &auth).await?;
    let tables = TableStore::open(store, &settings.parquet).await?;
    let pool = CpuPool::pinned(settings.cpus, settings.cores.clone())?;
    let listener = TcpListener::bind(settings.listen)
        .await
        .map_err(|e| Error::io(format!("binding {}", settings.listen), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::io("reading the bound address", e))?;
    let url = settings.advertise.clone().unwrap_or_else(|| {
        if tls.is_some() {
            format!("grpc+tls://{addr}")
        } else {
            format!("grpc://{addr}")
        }
    });
    let exposed = !addr.ip().is_loopback();
    if exposed && (tls.is_none() || !auth.enabled()) {
        let missing = match (tls.is_none(), !auth.enabled()) {
            (true, true) => {
                "without TLS and without tenants: anyone who reaches it can read, overwrite and delete every table, in clear"
            }
            (true, false) => "without TLS: tokens and data cross the network in clear",
            _ => {
                "without tenants (--auth): anyone who reaches it can read, overwrite and delete every table"
            }
        };
        tracing::warn!("listening on {addr} {missing}");
        eprintln!("csd: WARNING: listening on {addr} {missing}");
    }
    let refs = crate::refs::RefStore::open(&tables, settings.ref_max_ttl).await?;
    let state = Arc::new(NodeState::new(
        &settings,
        NodeParts {
            tables,
            pool,
            location: url.clone(),
            refs,
            operators,
            auth: auth.clone(),
            ticket_key: key,
        },
    )?);
    // The read cache keeps ranges inside the memory budget.
    state
        .store()
        .set_read_cache(settings.read_cache, Some(state.node.memory.clone()));
    let sweep_task = tokio::spawn(crate::state::sweep_every(
        Arc::downgrade(&state),
        std::time::Duration::from_secs(1),
    ));
    let scrub_task = settings
        .scrub_rate
        .map(|r| tokio::spawn(crate::scrubber::scrub_every(Arc::downgrade(&state), r)));
    if auth.enabled() {
        state
            .admission
            .set_tenants(auth.shares())
            .map_err(|e| match e {
                Error::InvalidArgument(m) => Error::InvalidArgument(format!("tenants file: {m}")),
                e => e,
            })?;
    }
    let reload_task = settings.auth.as_ref().map(|path| {
        let (state, path) = (state.clone(), path.clone());
        tokio::spawn(async move {
            use tokio::signal::unix::{SignalKind, signal};
            let Ok(mut hup) = signal(SignalKind::hangup()) else {
                tracing::warn!("cannot listen for SIGHUP: the tenants file will not be re-read");
                return;
            };
            while hup.recv().await.is_some() {
                match reload(&state) {
                    Ok(n) => tracing::info!(tenants = n, file = %path.display(), "tenants file re-read"),
                    Err(e) => tracing::error!(file = %path.display(), "tenants file not re-read, the old tenants stay: {e}"),
                }
            }
        })
    });
    let (metrics_addr, metrics_task) = match settings.metrics_listen {
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
    let incoming = csd_protocol::tcp::incoming(listener);
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder
            .tls_config(tls)
            .map_err(|e| Error::external(StatusCode::InvalidArgument, "the TLS settings", e))?;
    }
    let server = tokio::spawn(async move {
        builder
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
    tracing::info!(%url, device = %settings.device, tenants = auth.enabled(), "storage node serving");
    Ok(RunningNode {
        addr,
        url,
        state,
        metrics_addr,
        background: [Some(sweep_task), reload_task, metrics_task, scrub_task]
            .into_iter()
            .flatten()
            .collect(),
        stop: Some(stop),
        server,
    })
}
