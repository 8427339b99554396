//! `csd scrub`: read every object a node stores from its device and check it.

use csd_client::{Error, Result};

use super::ClientCreds;

#[derive(clap::Args)]
pub(crate) struct ScrubArgs {
    /// Node URL.
    #[arg(long, default_value = "grpc://127.0.0.1:50051")]
    node: String,
    /// Only objects whose names start with this (e.g. `lineitem/`).
    #[arg(long, default_value = "")]
    prefix: String,
    #[command(flatten)]
    creds: ClientCreds,
}

/// Prints the report as JSON; damage found ends with exit code 4 (corrupt data),
/// naming the first damaged range.
pub(crate) async fn run(args: ScrubArgs) -> Result<()> {
    let report = args
        .creds
        .connect(&args.node)
        .await?
        .scrub(&args.prefix)
        .await?;
    println!(
        "{}",
        serde_json::to_string_pretty(&report).unwrap_or_default()
    );
    match report.damaged.first() {
        None => Ok(()),
        Some(first) => Err(Error::Runtime(csd_protocol::Error::Corrupt(format!(
            "{} damaged range(s) at {}; the first: {first}",
            report.damaged_count, args.node
        )))),
    }
}
