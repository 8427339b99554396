//! `csd put`: store a Parquet or CSV file as a table partition, or (with --images or
//! --text) a dataset (`id, label, data`) spread over partitions and nodes.

use std::path::PathBuf;

use csd_client::{Error, Result};
use indicatif::{ProgressBar, ProgressStyle};

use super::ClientCreds;
use super::put_file::read_file;

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
    /// Node URL (repeat for several nodes with --images, --text or --replicas).
    #[arg(long = "node", default_value = "grpc://127.0.0.1:50051")]
    nodes: Vec<String>,
    /// Store the partition whole on this many of the --node nodes (a file's chosen by
    /// rendezvous hashing of table/partition; a dataset's partition `p` on node
    /// `p % nodes` and the ones after it): queries and feature streams read any
    /// copy, and one whose node is lost is read from another. Acknowledged once
    /// every copy is durable; if any fails, the copies made are deleted. A file's
    /// partition must be new.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16))]
    replicas: u32,
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
        replicas,
        ..
    } = args;
    let file =
        file.ok_or_else(|| Error::InvalidInput("give a file, --images DIR or --text FILE".into()))?;
    if replicas > 1 {
        return super::put_copies::run(&creds, &file, &table, &partition, &nodes, replicas).await;
    }
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
        replicas,
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
                (partitions, replicas as usize),
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
                (partitions, replicas as usize),
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
