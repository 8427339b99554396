//! `csd rm`: delete a table or one partition (`table/partition`).

use csd_client::Result;

use super::ClientCreds;

#[derive(clap::Args)]
pub(crate) struct RmArgs {
    /// `table` or `table/partition`.
    target: String,
    /// Node URL.
    #[arg(long, default_value = "grpc://127.0.0.1:50051")]
    node: String,
    #[command(flatten)]
    creds: ClientCreds,
}

pub(crate) async fn run(args: RmArgs) -> Result<()> {
    let RmArgs {
        target,
        node,
        creds,
    } = args;
    let (table, partition) = match target.split_once('/') {
        Some((t, p)) => (t, Some(p)),
        None => (target.as_str(), None),
    };
    let n = creds.connect(&node).await?.delete(table, partition).await?;
    println!("deleted {target} ({n} objects)");
    Ok(())
}
