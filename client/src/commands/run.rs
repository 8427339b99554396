//! `csd run`: a WebAssembly module over a table at the nodes that hold it.

use std::path::PathBuf;

use csd_client::{Error, Result};
use csd_protocol::node_client::Tried;

use super::{ClientCreds, Format, print_batches};

#[derive(clap::Args)]
pub(crate) struct RunArgs {
    /// Storage node URL (repeat for several nodes).
    #[arg(long = "node", default_value = "grpc://127.0.0.1:50051")]
    nodes: Vec<String>,
    /// The module (.wasm); sent to a node only if it does not have it yet.
    #[arg(long)]
    wasm: PathBuf,
    /// The table it runs over.
    #[arg(long)]
    table: String,
    /// The columns it receives, comma-separated (default: all).
    #[arg(long, value_delimiter = ',')]
    columns: Vec<String>,
    /// A SQL filter on the rows it receives, evaluated at the nodes.
    #[arg(long = "where")]
    filter: Option<String>,
    /// Give the module no rows: it only reads the table's objects (a traversal, a
    /// pointer chase), so nothing is planned or scanned.
    #[arg(long, conflicts_with_all = ["columns", "filter"])]
    no_rows: bool,
    /// An argument for the module (repeatable).
    #[arg(long = "arg", value_name = "KEY=VALUE")]
    args: Vec<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
    /// Compression of the nodes' answers: auto (LZ4, and zstd for the pieces the link
    /// holds back), none, lz4 or zstd.
    #[arg(long, default_value = "auto")]
    compression: String,
    #[command(flatten)]
    creds: ClientCreds,
}

pub(crate) async fn run(args: RunArgs) -> Result<()> {
    let module = std::fs::read(&args.wasm).map_err(|e| Error::io(args.wasm.display(), e))?;
    let mut kv = std::collections::BTreeMap::new();
    for a in &args.args {
        let (k, v) = a
            .split_once('=')
            .ok_or_else(|| Error::InvalidInput(format!("--arg {a:?}: write KEY=VALUE")))?;
        kv.insert(k.to_string(), v.to_string());
    }
    let cluster =
        csd_query_pushdown::Cluster::connect_with(&args.nodes, &args.creds.credentials()?).await?;
    let session = cluster
        .session(csd_query_pushdown::SessionOptions {
            compression: args.compression.parse()?,
            ..Default::default()
        })
        .await?;
    let started = std::time::Instant::now();
    let r = session
        .run_wasm(&csd_query_pushdown::WasmJob {
            module: module.into(),
            table: args.table.clone(),
            columns: args.columns.clone(),
            filter: args.filter.clone(),
            args: kv,
            rows: !args.no_rows,
        })
        .await?;
    print_batches(&r.batches, args.format)?;
    let rows: usize = r.batches.iter().map(|b| b.num_rows()).sum();
    let received: u64 = r.endpoints.iter().map(|e| e.bytes_received).sum();
    let read: u64 = r
        .endpoints
        .iter()
        .filter_map(|e| e.report.as_ref())
        .map(|r| r.bytes_read)
        .sum();
    let back = r
        .endpoints
        .iter()
        .filter(|e| e.pushed_back.is_some())
        .count();
    let sent = r.endpoints.iter().filter(|e| e.module_sent).count();
    let leased = r
        .endpoints
        .iter()
        .filter(|e| {
            e.report
                .as_ref()
                .is_some_and(|r| r.admission.lease.is_some())
        })
        .count();
    eprintln!(
        "{rows} rows from module {} over {} partitions in {:.3} s; {read} bytes read at the nodes, {received} bytes received{}{}{}",
        r.digest.short(),
        r.endpoints.len(),
        started.elapsed().as_secs_f64(),
        if leased > 0 {
            format!("; {leased} on leases")
        } else {
            String::new()
        },
        if sent > 0 {
            format!("; module sent to {sent} partitions' nodes")
        } else {
            String::new()
        },
        if back > 0 {
            format!("; {back} handed back and run here")
        } else {
            String::new()
        },
    );
    // Which copy of a partition ran the module when the one asked first did not.
    for e in r.endpoints.iter().filter(|e| !e.failed_over.is_empty()) {
        let ran = match e.pushed_back.is_some() {
            true => "none of its copies ran it",
            false => "ran it",
        };
        eprintln!(
            "{}: {ran}, after {}",
            e.endpoint,
            Tried::list(&e.failed_over)
        );
    }
    Ok(())
}
