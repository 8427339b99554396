//! `csd`: run a storage node, load data into it, inspect it, and run the demo.

use std::path::PathBuf;
use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use clap::{Parser, Subcommand};
use csd_client::{Error, NodeClient, Result, demo};
use csd_runtime::node::{self, NodeConfig};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Parser)]
#[command(
    name = "csd",
    version,
    about = "csd: computational-storage pushdown engine"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a storage node.
    Serve(ServeArgs),
    /// Store a Parquet or CSV file as a table partition.
    Put {
        /// Input file (.parquet or .csv).
        file: PathBuf,
        /// Table name.
        #[arg(long)]
        table: String,
        /// Partition name.
        #[arg(long, default_value = "0")]
        partition: String,
        /// Node URL.
        #[arg(long, default_value = "grpc://127.0.0.1:50051")]
        node: String,
    },
    /// List tables (and with --objects, stored objects).
    Ls {
        /// Node URL.
        #[arg(long, default_value = "grpc://127.0.0.1:50051")]
        node: String,
        /// Also list raw objects.
        #[arg(long)]
        objects: bool,
    },
    /// Delete a table or one partition (`table/partition`).
    Rm {
        /// `table` or `table/partition`.
        target: String,
        /// Node URL.
        #[arg(long, default_value = "grpc://127.0.0.1:50051")]
        node: String,
    },
    /// Print node, device and object-store figures as JSON.
    Stats {
        /// Node URL.
        #[arg(long, default_value = "grpc://127.0.0.1:50051")]
        node: String,
    },
    /// Start an embedded node, store a generated TPC-H table, read it back.
    Demo {
        /// TPC-H scale factor.
        #[arg(long, default_value_t = 0.1)]
        scale: f64,
        /// Device spec (default: an io_uring file in the temp directory).
        #[arg(long)]
        device: Option<String>,
        /// Keep the device file.
        #[arg(long)]
        keep: bool,
    },
}

#[derive(clap::Args)]
struct ServeArgs {
    /// TOML file with the same keys as these flags (flags win).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Device: a file or raw device path (io_uring + O_DIRECT), or
    /// `emulated:mem|file=PATH[,latency_us=..,read_mbps=..,write_mbps=..,queue_depth=..,parallelism=..]`.
    #[arg(long)]
    device: Option<String>,
    /// Capacity of a new device file or emulated device (e.g. 64GiB).
    #[arg(long)]
    capacity: Option<String>,
    /// Listen address.
    #[arg(long)]
    listen: Option<String>,
    /// URL advertised to clients (default grpc://<listen address>).
    #[arg(long)]
    advertise: Option<String>,
    /// CPU workers for operator work.
    #[arg(long)]
    cpus: Option<usize>,
    /// Memory budget (e.g. 2GiB).
    #[arg(long)]
    memory: Option<String>,
    /// Erase and format the device.
    #[arg(long)]
    format: bool,
}

fn progress(total: u64, what: &str) -> ProgressBar {
    let style = ProgressStyle::with_template(&format!(
        "{what} [{{bar:30}}] {{bytes}}/{{total_bytes}} {{bytes_per_sec}} {{msg}}"
    ))
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    ProgressBar::new(total).with_style(style)
}

/// Reads a Parquet or CSV file into (schema, batches) on a blocking thread, feeding a channel.
fn read_file(
    path: PathBuf,
    bar: ProgressBar,
) -> Result<(SchemaRef, tokio::sync::mpsc::Receiver<Result<RecordBatch>>)> {
    let file = std::fs::File::open(&path)
        .map_err(|e| Error::InvalidInput(format!("{}: {e}", path.display())))?;
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let bad = |e: &dyn std::fmt::Display| Error::InvalidInput(format!("{}: {e}", path.display()));
    let (schema, reader): (
        SchemaRef,
        Box<dyn Iterator<Item = Result<RecordBatch, arrow::error::ArrowError>> + Send>,
    ) = match ext.as_str() {
        "parquet" | "pq" => {
            let b = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
                .map_err(|e| bad(&e))?;
            let schema = b.schema().clone();
            (
                schema,
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
            (schema, Box::new(r))
        }
        _ => {
            return Err(Error::InvalidInput(format!(
                "{}: expected a .parquet or .csv file",
                path.display()
            )));
        }
    };
    let meta_len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    std::thread::spawn(move || {
        let mut rows = 0usize;
        for b in reader {
            let item = b.map_err(|e| Error::InvalidInput(format!("{}: {e}", path.display())));
            if let Ok(b) = &item {
                rows += b.num_rows();
                // Progress by rows read, scaled to the file size.
                bar.set_message(format!("{rows} rows"));
                bar.set_position(
                    (bar.position() + (b.get_array_memory_size() as u64).min(meta_len / 8 + 1))
                        .min(meta_len),
                );
            }
            if tx.blocking_send(item).is_err() {
                break;
            }
        }
        bar.set_position(meta_len);
    });
    Ok((schema, rx))
}

async fn serve(args: ServeArgs) -> Result<()> {
    let mut config = match &args.config {
        Some(p) => NodeConfig::from_toml_file(p)?,
        None => NodeConfig::default(),
    };
    if let Some(v) = args.device {
        config.device = v;
    }
    if let Some(v) = args.capacity {
        config.capacity = Some(v);
    }
    if let Some(v) = args.listen {
        config.listen = v;
    }
    if let Some(v) = args.advertise {
        config.advertise = Some(v);
    }
    if let Some(v) = args.cpus {
        config.cpus = v;
    }
    if let Some(v) = args.memory {
        config.memory = v;
    }
    config.format |= args.format;
    let node = node::start(&config).await?;
    println!(
        "csd storage node listening on {} (device {})",
        node.url, config.device
    );
    tokio::select! {
        r = tokio::signal::ctrl_c() => {
            r.map_err(|e| Error::InvalidInput(format!("signal handler: {e}")))?;
            println!("shutting down");
            node.shutdown().await?;
        }
    }
    Ok(())
}

async fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Serve(args) => serve(args).await,
        Command::Put {
            file,
            table,
            partition,
            node,
        } => {
            let client = NodeClient::connect(&node).await?;
            let total = std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0);
            let bar = progress(total, "put");
            let (schema, rx) = read_file(file.clone(), bar.clone())?;
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
        Command::Ls { node, objects } => {
            let client = NodeClient::connect(&node).await?;
            let tables = client.list_tables("").await?;
            println!(
                "{:<24} {:>12} {:>14} {:>10}",
                "table", "rows", "bytes", "partitions"
            );
            for t in &tables {
                println!(
                    "{:<24} {:>12} {:>14} {:>10}",
                    t.name,
                    t.rows,
                    t.bytes,
                    t.description.partitions.len()
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
        Command::Rm { target, node } => {
            let n = NodeClient::connect(&node).await?.delete(&target).await?;
            println!("deleted {target} ({n} objects)");
            Ok(())
        }
        Command::Stats { node } => {
            let s = NodeClient::connect(&node).await?.stats().await?;
            println!("{}", serde_json::to_string_pretty(&s).unwrap_or_default());
            Ok(())
        }
        Command::Demo {
            scale,
            device,
            keep,
        } => {
            demo::run(demo::DemoOptions {
                scale,
                device,
                keep,
                ..Default::default()
            })
            .await
        }
    }
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let level = if matches!(cli.command, Command::Serve(_)) {
        "info"
    } else {
        "warn"
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| level.into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("csd: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("csd: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
