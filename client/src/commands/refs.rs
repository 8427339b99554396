//! `csd refs`: this tenant's kept results at a node, one JSON object a line.

use csd_client::Result;

use super::ClientCreds;

#[derive(clap::Args)]
pub(crate) struct RefsArgs {
    /// Node URL.
    #[arg(long, default_value = "grpc://127.0.0.1:50051")]
    node: String,
    #[command(flatten)]
    creds: ClientCreds,
}

pub(crate) async fn run(args: RefsArgs) -> Result<()> {
    let RefsArgs { node, creds } = args;
    for r in creds.connect(&node).await?.refs().await? {
        println!("{}", serde_json::to_string(&r).unwrap_or_default());
    }
    Ok(())
}
