//! `csd stats`: a node's figures (or a gateway's, with `--gateway`) as JSON.

use csd_client::Result;

use super::ClientCreds;

#[derive(clap::Args)]
pub(crate) struct StatsArgs {
    /// Node URL.
    #[arg(long, default_value = "grpc://127.0.0.1:50051")]
    node: String,
    /// A `csd gateway`'s URL instead: its sessions, statements and queries.
    #[arg(long, conflicts_with = "node")]
    gateway: Option<String>,
    #[command(flatten)]
    creds: ClientCreds,
}

pub(crate) async fn run(args: StatsArgs) -> Result<()> {
    let StatsArgs {
        node,
        gateway,
        creds,
    } = args;
    let json = match gateway {
        Some(url) => {
            let s = creds
                .connect(&url)
                .await?
                .action(&csd_protocol::GatewayStatsRequest {})
                .await?;
            serde_json::to_string_pretty(&s)
        }
        None => serde_json::to_string_pretty(&creds.connect(&node).await?.stats().await?),
    };
    println!("{}", json.unwrap_or_default());
    Ok(())
}
