//! `csd invoke`: call a shipped module's function on a lease, over the rows of an
//! Arrow IPC file.

use std::path::PathBuf;

use csd_client::{Error, Result};

use super::{ClientCreds, Format, print_batches};

#[derive(clap::Args)]
pub(crate) struct InvokeArgs {
    /// The lease's id (from `csd lease`).
    lease: String,
    /// Node URL.
    #[arg(long, default_value = "grpc://127.0.0.1:50051")]
    node: String,
    /// The module (.wasm); sent only if the node lacks it.
    #[arg(long)]
    wasm: PathBuf,
    /// The export to call.
    #[arg(long)]
    export: String,
    /// The arguments: an Arrow IPC file (or stream) whose columns are the
    /// function's arguments, in order.
    #[arg(long)]
    input: PathBuf,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
    #[command(flatten)]
    creds: ClientCreds,
}

pub(crate) async fn run(args: InvokeArgs) -> Result<()> {
    let InvokeArgs {
        lease,
        node,
        wasm,
        export,
        input,
        format,
        creds,
    } = args;
    let module = std::fs::read(&wasm).map_err(|e| Error::io(wasm.display(), e))?;
    let bytes = std::fs::read(&input).map_err(|e| Error::io(input.display(), e))?;
    let batches: Vec<arrow::record_batch::RecordBatch> =
        match arrow::ipc::reader::FileReader::try_new(std::io::Cursor::new(&bytes), None) {
            Ok(r) => r.collect::<std::result::Result<_, _>>(),
            Err(_) => arrow::ipc::reader::StreamReader::try_new(std::io::Cursor::new(&bytes), None)
                .and_then(|r| r.collect()),
        }
        .map_err(|e| {
            Error::InvalidInput(format!(
                "{}: not an Arrow IPC file or stream: {e}",
                input.display()
            ))
        })?;
    let c = creds.connect(&node).await?;
    let digest = csd_protocol::ModuleDigest::of(&module);
    let mut out = Vec::new();
    let started = std::time::Instant::now();
    for b in &batches {
        let r = c.invoke(&lease, &digest, &module, &export, b).await?;
        eprintln!("{} rows: {}", b.num_rows(), r.start);
        out.push(
            arrow::record_batch::RecordBatch::try_from_iter([(export.as_str(), r.out)])
                .map_err(|e| Error::InvalidInput(e.to_string()))?,
        );
    }
    print_batches(&out, format)?;
    eprintln!(
        "{} calls in {:.1} ms",
        batches.len(),
        started.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}
