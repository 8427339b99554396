//! `csd release`: free kept results now.

use csd_client::Result;

use super::{ClientCreds, read_refs};

#[derive(clap::Args)]
pub(crate) struct ReleaseArgs {
    /// References: JSON objects, files of them (one a line), or - for stdin.
    #[arg(required = true)]
    refs: Vec<String>,
    /// Node URL (default: each reference's location).
    #[arg(long)]
    node: Option<String>,
    #[command(flatten)]
    creds: ClientCreds,
}

pub(crate) async fn run(args: ReleaseArgs) -> Result<()> {
    let ReleaseArgs { refs, node, creds } = args;
    for r in read_refs(&refs)? {
        let at = node.clone().unwrap_or_else(|| r.location.clone());
        let info = creds.connect(&at).await?.release(&r).await?;
        eprintln!(
            "released {} ({} rows, {} bytes)",
            info.id, info.rows, info.bytes
        );
    }
    Ok(())
}
