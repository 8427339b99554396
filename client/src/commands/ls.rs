//! `csd ls`: the tables a node holds (and with --objects, its stored objects).

use csd_client::Result;

use super::ClientCreds;

#[derive(clap::Args)]
pub(crate) struct LsArgs {
    /// Node URL.
    #[arg(long, default_value = "grpc://127.0.0.1:50051")]
    node: String,
    /// Also list raw objects.
    #[arg(long)]
    objects: bool,
    #[command(flatten)]
    creds: ClientCreds,
}

pub(crate) async fn run(args: LsArgs) -> Result<()> {
    let LsArgs {
        node,
        objects,
        creds,
    } = args;
    let client = creds.connect(&node).await?;
    let tables = client.list_tables("").await?;
    // Kept results' tables (`csd_ref_` and 32 hex digits) are wider than most.
    let w = tables
        .iter()
        .map(|t| t.name.len())
        .max()
        .unwrap_or(0)
        .max(24);
    println!(
        "{:<w$} {:>12} {:>14} {:>10}",
        "table", "rows", "bytes", "partitions"
    );
    // A table listed only for the deletes it remembers is not there.
    for t in tables
        .iter()
        .filter(|t| !t.description.partitions.is_empty())
    {
        println!(
            "{:<w$} {:>12} {:>14} {:>10}",
            t.name,
            t.rows,
            t.bytes,
            t.description.partitions.len()
        );
    }
    let remembered: usize = tables.iter().map(|t| t.description.deleted.len()).sum();
    if remembered > 0 {
        println!(
            "({remembered} deleted copies remembered for nodes that were out of reach; \
             `csd repair` removes them there)"
        );
    }
    if objects {
        println!(
            "{}",
            serde_json::to_string_pretty(&client.objects("").await?).unwrap_or_default()
        );
    }
    Ok(())
}
