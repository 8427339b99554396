//! `csd worker`: a compute-tier worker (datafusion-distributed) for `csd sql
//! --workers`, with its own connections to the storage nodes.

use csd_client::{Error, Result};

use super::{ClientCreds, announce, stop_signal};

#[derive(clap::Args)]
pub(crate) struct WorkerArgs {
    /// Address to serve the worker on.
    #[arg(long, default_value = "127.0.0.1:50061", env = "CSD_WORKER_LISTEN")]
    listen: std::net::SocketAddr,
    /// Storage nodes to connect to at start-up (repeatable; others named by a plan
    /// are connected when first needed).
    #[arg(long = "node")]
    nodes: Vec<String>,
    /// Fragments handed back by the nodes that this worker evaluates at once
    /// (default: its cores).
    #[arg(long)]
    local_slots: Option<usize>,
    #[command(flatten)]
    creds: ClientCreds,
}

pub(crate) async fn run(args: WorkerArgs) -> Result<()> {
    let env = csd_query_pushdown::WorkerEnv::new(args.creds.credentials()?, args.local_slots)?;
    env.connect(&args.nodes).await?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| Error::io(format!("binding {}", args.listen), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::io("the worker's address", e))?;
    announce(format_args!("csd worker listening on grpc://{addr}"));
    let stop = stop_signal()?;
    csd_query_pushdown::serve_worker_on(env, listener, stop).await?;
    Ok(())
}
