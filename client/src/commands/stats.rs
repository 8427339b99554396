//! `csd stats`: a node's figures as JSON.

use csd_client::Result;

use super::ClientCreds;

#[derive(clap::Args)]
pub(crate) struct StatsArgs {
    /// Node URL.
    #[arg(long, default_value = "grpc://127.0.0.1:50051")]
    node: String,
    #[command(flatten)]
    creds: ClientCreds,
}

pub(crate) async fn run(args: StatsArgs) -> Result<()> {
    let StatsArgs { node, creds } = args;
    let s = creds.connect(&node).await?.stats().await?;
    println!("{}", serde_json::to_string_pretty(&s).unwrap_or_default());
    Ok(())
}
