//! `csd put`: store a Parquet or CSV file as a table partition, or (with --images or
//! --text) a dataset (`id, label, data`) spread over partitions and nodes.

use std::path::PathBuf;
use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use csd_client::{Error, Result};
use indicatif::{ProgressBar, ProgressStyle};

use super::ClientCreds;

#[derive(clap::Args)]
pub(crate) struct PutArgs {
    /// Input file (.parquet or .csv).
    #[arg(required_unless_present_any = ["images", "text"])]
    file: Option<PathBuf>,
    /// A folder of JPEG/PNG images: class subfolders, or files named in --labels.
    #[arg(long, conflicts_with_all = ["file", "text"])]
    images: Option<PathBuf>,
    /// With --images: a CSV of `file,class` lines (paths relative to the folder).
    #[arg(long, requires = "images")]
    labels: Option<PathBuf>,
    /// Labelled text: a Parquet or CSV file (with a header) of --text-column and
    /// --label-column; each row is a UTF-8 sample (for text models, e.g. minilm-l6).
    #[arg(long, conflicts_with = "file")]
    text: Option<PathBuf>,
    /// With --text: the text column.
    #[arg(long, default_value = "text", requires = "text")]
    text_column: String,
    /// With --text: the label column (integers are kept; names are numbered in
    /// sorted order).
    #[arg(long, default_value = "label", requires = "text")]
    label_column: String,
    /// With --images or --text: partitions to spread the samples over (round-robin
    /// over nodes).
    #[arg(long, default_value_t = 1)]
    partitions: usize,
    /// Table name.
    #[arg(long)]
    table: String,
    /// Partition name (files only).
    #[arg(long, default_value = "0")]
    partition: String,
    /// Node URL (repeat for several nodes with --images or --text).
    #[arg(long = "node", default_value = "grpc://127.0.0.1:50051")]
    nodes: Vec<String>,
    #[command(flatten)]
    creds: ClientCreds,
}

pub(crate) async fn run(args: PutArgs) -> Result<()> {
    if args.images.is_some() || args.text.is_some() {
        return dataset(args).await;
    }
    let PutArgs {
        file,
        table,
        partition,
        nodes,
        creds,
        ..
    } = args;
    let file =
        file.ok_or_else(|| Error::InvalidInput("give a file, --images DIR or --text FILE".into()))?;
    let node = nodes.first().cloned().unwrap_or_default();
    let client = creds.connect(&node).await?;
    let (schema, bar, rx) = read_file(file.clone())?;
    let s = client
        .put(
            &table,
            &partition,
            schema,
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )
        .await?;
    bar.finish_and_clear();
    println!(
        "stored {} rows of {} into {}/{} as {} ({} bytes, {} row groups)",
        s.rows,
        file.display(),
        s.table,
        s.partition,
        s.object,
        s.bytes,
        s.row_groups
    );
    Ok(())
}

/// `--images` or `--text`: a dataset spread over partitions and nodes.
async fn dataset(args: PutArgs) -> Result<()> {
    let PutArgs {
        images,
        labels,
        text,
        text_column,
        label_column,
        partitions,
        table,
        nodes,
        creds,
        ..
    } = args;
    let mut clients = Vec::new();
    for n in &nodes {
        clients.push(creds.connect(n).await?);
    }
    let what = if images.is_some() { "images" } else { "texts" };
    let bar = ProgressBar::new_spinner().with_style(
        ProgressStyle::with_template(&format!("{{spinner}} storing {{pos}} {what} {{per_sec}}"))
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    let progress = |k| bar.inc(k);
    let stored = match (images, text) {
        (Some(dir), _) => {
            csd_client::features::put_images(
                &clients,
                &table,
                &dir,
                labels.as_deref(),
                partitions,
                1,
                progress,
            )
            .await
        }
        (None, Some(file)) => {
            csd_client::features::put_text(
                &clients,
                &table,
                &file,
                &text_column,
                &label_column,
                partitions,
                progress,
            )
            .await
        }
        (None, None) => return Err(Error::InvalidInput("give --images or --text".into())),
    };
    let (n, classes) = stored?;
    bar.finish_and_clear();
    print_stored(n, what, &classes, &table, partitions, clients.len());
    Ok(())
}

/// Reads a Parquet or CSV file on a blocking thread, feeding a channel and a progress
/// bar (rows of the known total for Parquet; a row count for CSV).
fn read_file(
    path: PathBuf,
) -> Result<(
    SchemaRef,
    ProgressBar,
    tokio::sync::mpsc::Receiver<csd_protocol::node_client::Result<RecordBatch>>,
)> {
    let file = std::fs::File::open(&path).map_err(|e| Error::io(path.display(), e))?;
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    let bad = |e: &dyn std::fmt::Display| Error::InvalidInput(format!("{}: {e}", path.display()));
    type Batches = Box<dyn Iterator<Item = Result<RecordBatch, arrow::error::ArrowError>> + Send>;
    let (schema, total, reader): (SchemaRef, Option<u64>, Batches) = match ext.as_str() {
        "parquet" | "pq" => {
            let b = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
                .map_err(|e| bad(&e))?;
            let rows = b.metadata().file_metadata().num_rows().max(0) as u64;
            (
                b.schema().clone(),
                Some(rows),
                Box::new(b.with_batch_size(8192).build().map_err(|e| bad(&e))?),
            )
        }
        "csv" => {
            use std::io::Seek;
            let mut file = file;
            let fmt = arrow::csv::reader::Format::default().with_header(true);
            let (schema, _) = fmt
                .infer_schema(&mut file, Some(10_000))
                .map_err(|e| bad(&e))?;
            file.rewind().map_err(|e| bad(&e))?;
            let schema = Arc::new(schema);
            let r = arrow::csv::ReaderBuilder::new(schema.clone())
                .with_format(fmt)
                .build(file)
                .map_err(|e| bad(&e))?;
            (schema, None, Box::new(r))
        }
        _ => {
            return Err(Error::InvalidInput(format!(
                "{}: expected a .parquet or .csv file",
                path.display()
            )));
        }
    };
    let bar = match total {
        Some(n) => ProgressBar::new(n).with_style(
            ProgressStyle::with_template("put [{bar:30}] {pos}/{len} rows {per_sec} eta {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        ),
        None => ProgressBar::new_spinner().with_style(
            ProgressStyle::with_template("put {spinner} {pos} rows {per_sec}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        ),
    };
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let feed = bar.clone();
    std::thread::spawn(move || {
        for b in reader {
            let item = b.map_err(|e| {
                csd_protocol::node_client::Error::InvalidInput(format!("{}: {e}", path.display()))
            });
            if let Ok(b) = &item {
                feed.inc(b.num_rows() as u64);
            }
            if tx.blocking_send(item).is_err() {
                break;
            }
        }
    });
    Ok((schema, bar, rx))
}

fn print_stored(n: usize, what: &str, classes: &[String], table: &str, parts: usize, nodes: usize) {
    let labels = if classes.is_empty() {
        "as given".to_string()
    } else {
        classes
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{i}={c}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "stored {n} {what} of {} classes into {table} ({parts} partitions over {nodes} nodes); labels: {labels}",
        if classes.is_empty() {
            "integer".to_string()
        } else {
            classes.len().to_string()
        },
    );
}
