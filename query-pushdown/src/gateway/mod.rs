//! `csd gateway`: an Arrow Flight SQL server in front of the cluster, so that the
//! tools people query databases with — ADBC (Python DBAPI, pandas, polars), JDBC,
//! DBeaver, Superset, Grafana — query csd, with the same pushdown as `csd sql`.
//!
//! Every call plans with a [`CsdSession`](crate::CsdSession) of the caller's own
//! (its tables as the nodes show the caller's tenant), so answers, pushdown and
//! `EXPLAIN` are `csd sql`'s. Statement handles are stateless (`handle.rs`): any
//! replica answers any step. Answers stream batch by batch from the nodes to the
//! client; cancelling or going away stops the nodes' work (`running.rs`).
//!
//! Inside: `handle`, `params`, `auth`, `stats`, `running`, `sessions` < `state` <
//! `metadata` < `service` < `server` < this module.

mod auth;
mod handle;
mod metadata;
mod params;
mod running;
mod server;
mod service;
mod sessions;
mod state;
mod stats;

use std::sync::Arc;

use csd_protocol::Error;
use csd_protocol::node_client::{Credentials, NodeClient};
use tonic::transport::{Certificate, Identity, ServerTlsConfig};

use crate::compute::session::SessionOptions;
use state::Gateway;

/// The gateway port's TLS: its certificate and key, and the CA client certificates
/// must chain to (mutual TLS) if any.
#[derive(Clone)]
pub struct GatewayTls {
    /// Certificate chain (PEM).
    pub cert_pem: Vec<u8>,
    /// Private key (PEM).
    pub key_pem: Vec<u8>,
    /// CA of client certificates (PEM); `None`: clients need none.
    pub client_ca_pem: Option<Vec<u8>>,
}

/// What a gateway serves.
#[derive(Clone)]
pub struct GatewayOptions {
    /// Storage node URLs.
    pub nodes: Vec<String>,
    /// How to reach the nodes (TLS roots, client certificate). Its token is not
    /// used: the gateway asks the nodes with each caller's own.
    pub credentials: Credentials,
    /// Pushdown, compression and the other session settings, as for `csd sql`.
    pub session: SessionOptions,
    /// TLS on the gateway's own port.
    pub tls: Option<GatewayTls>,
}

fn tls_config(tls: &GatewayTls) -> ServerTlsConfig {
    let mut config =
        ServerTlsConfig::new().identity(Identity::from_pem(&tls.cert_pem, &tls.key_pem));
    if let Some(ca) = &tls.client_ca_pem {
        config = config.client_ca_root(Certificate::from_pem(ca));
    }
    config
}

/// Serves a gateway over `options.nodes` on `listener` until `shutdown` resolves.
pub async fn serve_gateway_on(
    options: GatewayOptions,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    if options.nodes.is_empty() {
        return Err(Error::InvalidArgument(
            "no storage nodes given (--node URL)".into(),
        ));
    }
    let credentials = Credentials {
        token: None,
        ..options.credentials.clone()
    };
    let mut nodes = Vec::with_capacity(options.nodes.len());
    for url in &options.nodes {
        nodes.push(
            NodeClient::connect_with(url, &credentials)
                .await
                .map_err(|e| Error::external(e.status_code(), "connecting to a node", e))?,
        );
    }
    let gateway = Gateway::new(nodes, options.session);
    let incoming = csd_protocol::tcp::incoming(listener);
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = &options.tls {
        builder = builder.tls_config(tls_config(tls)).map_err(|e| {
            Error::external(
                csd_protocol::StatusCode::InvalidArgument,
                "the gateway's TLS settings",
                e,
            )
        })?;
    }
    builder
        .initial_stream_window_size(csd_protocol::STREAM_WINDOW)
        .initial_connection_window_size(csd_protocol::CONNECTION_WINDOW)
        .add_service(server::GatewayServer(Arc::new(gateway)).into_server())
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .map_err(|e| {
            Error::external(
                csd_protocol::StatusCode::Internal,
                "the gateway's gRPC server",
                e,
            )
        })
}
