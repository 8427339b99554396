//! `csd renew`: extend kept results to --ttl from now.

use csd_client::Result;

use super::{ClientCreds, parse_ttl, read_refs};

#[derive(clap::Args)]
pub(crate) struct RenewArgs {
    /// References: JSON objects, files of them (one a line), or - for stdin.
    #[arg(required = true)]
    refs: Vec<String>,
    /// How long from now.
    #[arg(long, default_value = "10m", value_parser = parse_ttl)]
    ttl: std::time::Duration,
    #[command(flatten)]
    creds: ClientCreds,
}

pub(crate) async fn run(args: RenewArgs) -> Result<()> {
    let RenewArgs { refs, ttl, creds } = args;
    for r in read_refs(&refs)? {
        let renewed = creds.connect(&r.location).await?.renew(&r, ttl).await?;
        println!("{}", serde_json::to_string(&renewed).unwrap_or_default());
    }
    Ok(())
}
