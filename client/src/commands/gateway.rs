//! `csd gateway`: an Arrow Flight SQL server in front of the nodes, for ADBC, JDBC
//! and BI tools (queries only; each caller asks the nodes with its own token).

use std::path::PathBuf;

use csd_client::{Error, Result};

use super::{ClientCreds, announce, stop_signal};

#[derive(clap::Args)]
pub(crate) struct GatewayArgs {
    /// Address to serve Flight SQL on.
    #[arg(long, default_value = "127.0.0.1:50071", env = "CSD_GATEWAY_LISTEN")]
    listen: std::net::SocketAddr,
    /// Storage node URL (repeat for several nodes).
    #[arg(long = "node", default_value = "grpc://127.0.0.1:50051")]
    nodes: Vec<String>,
    /// Read everything to the gateway and run queries here (the baseline).
    #[arg(long)]
    no_pushdown: bool,
    /// Compression of pushed-down answers: auto (LZ4, and zstd for the pieces the link
    /// holds back), none, lz4 or zstd.
    #[arg(long, default_value = "auto")]
    compression: String,
    /// Certificate (PEM) of the gateway's own port: clients then connect with
    /// `grpc+tls://` (with --listen-tls-key).
    #[arg(long, env = "CSD_GATEWAY_TLS_CERT", requires = "listen_tls_key")]
    listen_tls_cert: Option<PathBuf>,
    /// The gateway certificate's private key (PEM).
    #[arg(long, env = "CSD_GATEWAY_TLS_KEY", requires = "listen_tls_cert")]
    listen_tls_key: Option<PathBuf>,
    /// CA (PEM) that clients' certificates must chain to (mutual TLS).
    #[arg(long, env = "CSD_GATEWAY_CLIENT_CA", requires = "listen_tls_cert")]
    listen_client_ca: Option<PathBuf>,
    /// How the gateway reaches TLS nodes (`--tls-ca`, `--tls-cert`/`--tls-key` for
    /// mutual TLS). A `--token` is not used: callers' own tokens are.
    #[command(flatten)]
    creds: ClientCreds,
}

fn read(path: &PathBuf, what: &str) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::io(format!("reading the {what} {}", path.display()), e))
}

pub(crate) async fn run(args: GatewayArgs) -> Result<()> {
    let tls = match (&args.listen_tls_cert, &args.listen_tls_key) {
        (Some(cert), Some(key)) => Some(csd_query_pushdown::GatewayTls {
            cert_pem: read(cert, "gateway certificate")?,
            key_pem: read(key, "gateway key")?,
            client_ca_pem: args
                .listen_client_ca
                .as_ref()
                .map(|ca| read(ca, "client CA"))
                .transpose()?,
        }),
        _ => None,
    };
    let mut credentials = args.creds.credentials()?;
    if credentials.token.take().is_some() {
        eprintln!(
            "csd gateway: --token / CSD_TOKEN is not used; the nodes are asked with each caller's own token"
        );
    }
    let options = csd_query_pushdown::GatewayOptions {
        nodes: args.nodes.clone(),
        credentials,
        session: csd_query_pushdown::SessionOptions {
            pushdown: !args.no_pushdown,
            compression: args.compression.parse()?,
            ..Default::default()
        },
        tls: tls.clone(),
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| Error::io(format!("binding {}", args.listen), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::io("the gateway's address", e))?;
    let scheme = if tls.is_some() { "grpc+tls" } else { "grpc" };
    announce(format_args!(
        "csd gateway (Flight SQL) listening on {scheme}://{addr} for {} node(s)",
        args.nodes.len()
    ));
    let stop = stop_signal()?;
    csd_query_pushdown::serve_gateway_on(options, listener, stop).await?;
    Ok(())
}
