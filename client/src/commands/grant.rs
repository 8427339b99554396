//! `csd grant`: let another tenant read kept results (or, with --revoke, no longer).

use csd_client::Result;

use super::{ClientCreds, read_refs};

#[derive(clap::Args)]
pub(crate) struct GrantArgs {
    /// References: JSON objects, files of them (one a line), or - for stdin.
    #[arg(required = true)]
    refs: Vec<String>,
    /// The tenant to grant them to.
    #[arg(long)]
    to: String,
    /// Take the grant back.
    #[arg(long)]
    revoke: bool,
    #[command(flatten)]
    creds: ClientCreds,
}

pub(crate) async fn run(args: GrantArgs) -> Result<()> {
    let GrantArgs {
        refs,
        to,
        revoke,
        creds,
    } = args;
    for r in read_refs(&refs)? {
        let granted = creds
            .connect(&r.location)
            .await?
            .grant(&r, &to, revoke)
            .await?;
        if revoke {
            eprintln!("{to} may no longer read {}", granted.table);
        } else {
            println!("{}", serde_json::to_string(&granted).unwrap_or_default());
        }
    }
    Ok(())
}
