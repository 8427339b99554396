//! `csd get`: stream kept results (references) and print them, or write them to a
//! file as they arrive.

use std::path::PathBuf;

use csd_client::Result;

use super::{BatchFile, ClientCreds, Format, print_batches, read_refs};

#[derive(clap::Args)]
pub(crate) struct GetArgs {
    /// References: JSON objects, files of them (one a line), or - for stdin.
    #[arg(required = true)]
    refs: Vec<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
    /// Write the rows to this file instead of printing them, as they arrive:
    /// Arrow IPC (`.arrow`, `.ipc`, `.feather`) or Parquet (any other name).
    /// For what CSV cannot hold (features, lists).
    #[arg(long)]
    out: Option<PathBuf>,
    #[command(flatten)]
    creds: ClientCreds,
}

pub(crate) async fn run(args: GetArgs) -> Result<()> {
    let GetArgs {
        refs,
        format,
        out,
        creds,
    } = args;
    use futures::TryStreamExt;
    let refs = read_refs(&refs)?;
    if let Some(path) = out {
        let mut file = BatchFile::default();
        for r in &refs {
            let client = creds.connect(&r.location).await?;
            let mut stream = client.resolve(r).await?;
            while let Some(b) = stream.try_next().await? {
                file.write(&path, &b)?;
            }
        }
        let rows = file.finish()?;
        eprintln!("{rows} rows written to {}", path.display());
        return Ok(());
    }
    let mut batches = Vec::new();
    for r in refs {
        let client = creds.connect(&r.location).await?;
        let got: Vec<_> = client.resolve(&r).await?.try_collect().await?;
        batches.extend(got);
    }
    print_batches(&batches, format)?;
    eprintln!(
        "{} rows",
        batches.iter().map(|b| b.num_rows()).sum::<usize>()
    );
    Ok(())
}
