//! Configuration and start-up of a whole storage node.

use std::net::SocketAddr;
use std::sync::Arc;

use arrow_flight::flight_service_server::FlightServiceServer;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::admission::Admission;
use crate::auth::{Auth, TICKET_KEY_OBJECT, TicketKey};
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
    state
        .admission
        .set_tenants(state.auth.shares())
        .map_err(Error::InvalidArgument)?;
    Ok(n)
}

/// The node's ticket key: from `--ticket-key`, else (with tenants) kept on the device,
/// made once; a node without tenants seals nothing and keeps a key in memory only.
async fn ticket_key(config: &NodeConfig, store: &ObjectStore, auth: &Auth) -> Result<TicketKey> {
    if let Some(path) = &config.ticket_key {
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

/// The Flight port's TLS settings, if it has any.
fn tls_config(config: &NodeConfig) -> Result<Option<ServerTlsConfig>> {
    let (cert, key) = match (&config.tls_cert, &config.tls_key) {
        (Some(c), Some(k)) => (c, k),
        (None, None) if config.tls_client_ca.is_some() => {
            return Err(Error::InvalidArgument(
                "--tls-client-ca needs --tls-cert and --tls-key".into(),
            ));
        }
        (None, None) => return Ok(None),
        _ => {
            return Err(Error::InvalidArgument(
                "--tls-cert and --tls-key go together".into(),
            ));
        }
    };
    let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(
        read_pem(cert, "TLS certificate")?,
        read_pem(key, "TLS key")?,
    ));
    if let Some(ca) = &config.tls_client_ca {
        tls = tls.client_ca_root(Certificate::from_pem(read_pem(ca, "client CA")?));
    }
    Ok(Some(tls))
}

fn is_loopback(addr: &str) -> bool {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
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
    .map_err(|e| Error::external(StatusCode::Internal, "opening the device", e))??;
    let opts = StoreOptions {
        format: if config.format {
            FormatMode::Force
        } else {
            FormatMode::IfBlank
        },
        ..Default::default()
    };
    let store = ObjectStore::open(dev, opts).await?;
    let tls = tls_config(config)?;
    let auth = Arc::new(match &config.auth {
        Some(path) => Auth::from_file(path)?,
        None => Auth::open(),
    });
    let key = ticket_key(config, &store, &auth).await?;
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
    let url = config.advertise.clone().unwrap_or_else(|| {
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
    if let Some(m) = &config.metrics_listen
        && (tls.is_some() || auth.enabled())
        && !is_loopback(m)
        && !config.metrics_public
    {
        return Err(Error::InvalidArgument(format!(
            "metrics would be served in clear to anyone on {m} while the Flight port is protected: bind them to 127.0.0.1, or pass --metrics-public"
        )));
    }
    let refs = crate::refs::RefStore::open(
        &tables,
        std::time::Duration::from_secs(config.ref_max_ttl_s.max(1)),
    )
    .await?;
    let state = Arc::new(
        NodeState::new(
            tables,
            pool,
            url.clone(),
            memory_budget,
            config.sandbox_limits(),
            refs,
        )?
        .with_operators(operators)
        .with_admission(Admission::new(admission))
        .with_wire(config.range_chunk.bytes(), config.wire_piece.bytes())
        .with_lease_max(std::time::Duration::from_secs(config.lease_max_s.max(1)))
        .with_auth(
            auth.clone(),
            key,
            std::time::Duration::from_secs(config.ticket_ttl_s.max(1)),
        ),
    );
    // The read cache keeps ranges inside the memory budget.
    state
        .store()
        .set_read_cache(config.read_cache_bytes(), Some(state.node.memory.clone()));
    let sweep_task = tokio::spawn(crate::state::sweep_every(
        Arc::downgrade(&state),
        std::time::Duration::from_secs(1),
    ));
    let scrub_task = config.scrub_rate.filter(|r| r.bytes() > 0).map(|r| {
        tokio::spawn(crate::scrubber::scrub_every(
            Arc::downgrade(&state),
            r.bytes(),
        ))
    });
    if auth.enabled() {
        state
            .admission
            .set_tenants(auth.shares())
            .map_err(|e| Error::InvalidArgument(format!("tenants file: {e}")))?;
    }
    let reload_task = config.auth.as_ref().map(|path| {
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
    tracing::info!(%url, device = %spec, tenants = auth.enabled(), "storage node serving");
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
