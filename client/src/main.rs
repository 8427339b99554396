//! `csd`: run a storage node, load data into it, inspect it, and run the demo.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use csd_client::script::{split_statements, statements};
use csd_client::{Error, NodeClient, Result, demo};
use csd_runtime::config::NodeConfig;
use csd_runtime::node;
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
    /// Store a Parquet or CSV file as a table partition, or (with --images or --text) a
    /// dataset (`id, label, data`) spread over --partitions partitions.
    Put {
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
    },
    /// Stream DNN features of a dataset, with the first layers run at the storage nodes
    /// (or print the split plan with --explain).
    Features(FeaturesArgs),
    /// List tables (and with --objects, stored objects).
    Ls {
        /// Node URL.
        #[arg(long, default_value = "grpc://127.0.0.1:50051")]
        node: String,
        /// Also list raw objects.
        #[arg(long)]
        objects: bool,
        #[command(flatten)]
        creds: ClientCreds,
    },
    /// Delete a table or one partition (`table/partition`).
    Rm {
        /// `table` or `table/partition`.
        target: String,
        /// Node URL.
        #[arg(long, default_value = "grpc://127.0.0.1:50051")]
        node: String,
        #[command(flatten)]
        creds: ClientCreds,
    },
    /// Stream kept results (references printed by `csd sql --keep`) and print them.
    Get {
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
    },
    /// List this tenant's kept results at a node, one JSON object a line.
    Refs {
        /// Node URL.
        #[arg(long, default_value = "grpc://127.0.0.1:50051")]
        node: String,
        #[command(flatten)]
        creds: ClientCreds,
    },
    /// Free kept results now.
    Release {
        /// References: JSON objects, files of them (one a line), or - for stdin.
        #[arg(required = true)]
        refs: Vec<String>,
        /// Node URL (default: each reference's location).
        #[arg(long)]
        node: Option<String>,
        #[command(flatten)]
        creds: ClientCreds,
    },
    /// Let another tenant read kept results (or with --revoke, no longer); prints
    /// each reference as that tenant resolves it (`csd get` it with its token).
    Grant {
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
    },
    /// Extend kept results to --ttl from now.
    Renew {
        /// References: JSON objects, files of them (one a line), or - for stdin.
        #[arg(required = true)]
        refs: Vec<String>,
        /// How long from now.
        #[arg(long, default_value = "10m", value_parser = parse_ttl)]
        ttl: std::time::Duration,
        #[command(flatten)]
        creds: ClientCreds,
    },
    /// Lease CPU slots of a node for a while, to invoke shipped functions on without
    /// queueing; prints the lease as JSON (its `id` is what `csd invoke` takes).
    Lease {
        /// Node URL.
        #[arg(long, default_value = "grpc://127.0.0.1:50051")]
        node: String,
        /// Slots.
        #[arg(long, default_value_t = 1)]
        slots: usize,
        /// How long, in seconds.
        #[arg(long, default_value_t = 60.0)]
        seconds: f64,
        /// End the lease LEASE now instead.
        #[arg(long, value_name = "LEASE", conflicts_with_all = ["slots", "seconds", "hold"])]
        release: Option<String>,
        /// Hold the lease while this command runs (until Ctrl-C): the node ends it
        /// once this process has been silent for --idle-s, so a holder that dies
        /// gives the slots back.
        #[arg(long)]
        hold: bool,
        /// With --hold: the idle limit, in seconds.
        #[arg(long, default_value_t = 10.0, requires = "hold")]
        idle_s: f64,
        /// Memory held for the pushed work run on the lease (`csd sql --lease`,
        /// `csd run --lease`), e.g. 512MiB; without it, that work draws on the
        /// node's free memory.
        #[arg(long)]
        memory: Option<csd_runtime::config::ByteSize>,
        #[command(flatten)]
        creds: ClientCreds,
    },
    /// Call a function of a WebAssembly module (the guest SDK's SQL-function ABI) on a
    /// lease, over the rows of an Arrow IPC file; prints the result column.
    Invoke {
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
    },
    /// Print node, device and object-store figures as JSON.
    Stats {
        /// Node URL.
        #[arg(long, default_value = "grpc://127.0.0.1:50051")]
        node: String,
        #[command(flatten)]
        creds: ClientCreds,
    },
    /// Tokens and certificates for nodes with tenants (`csd serve --auth`, TLS).
    #[command(subcommand)]
    Auth(AuthCmd),
    /// Run SQL over the nodes' tables, with the data-reducing part pushed to the nodes.
    ///
    /// Prints the result on stdout, and rows, time and bytes moved on stderr. With no
    /// query and no -f, reads statements from stdin (an interactive prompt on a
    /// terminal), each ended by `;`.
    Sql(SqlArgs),
    /// Run a compute-tier worker (datafusion-distributed) for `csd sql --workers`: it
    /// runs the stages of pushdown plans, with its own connections to the storage
    /// nodes (made with its own token and TLS settings).
    Worker(WorkerArgs),
    /// Run a WebAssembly module (a guest built with csd-guest, or any module speaking
    /// its ABI) over a table at the nodes that hold it; print the union of its outputs
    /// (or its merged aggregate) on stdout.
    Run(RunArgs),
    /// Start an embedded node, load TPC-H, run queries with and without pushdown.
    Demo {
        /// TPC-H scale factor.
        #[arg(long, default_value_t = 0.1)]
        scale: f64,
        /// Device spec (default: an io_uring file in the temp directory).
        #[arg(long)]
        device: Option<String>,
        /// Keep the device file (with --device it is kept anyway; this prints how to serve it).
        #[arg(long)]
        keep: bool,
    },
    /// Emulated clusters from scenario files (`testbed/scenarios/*.toml`): start
    /// nodes on 127.0.0.1 behind throttled links, run the workload under each policy,
    /// write report.md, report.json and SVG plots.
    #[command(subcommand)]
    Testbed(TestbedCmd),
}

#[derive(Subcommand)]
enum AuthCmd {
    /// Print the SHA-256 digest of a token, for `token_sha256` in a tenants file
    /// (reads the token from stdin when none is given, so it stays out of `ps`).
    Hash {
        /// The token.
        token: Option<String>,
    },
    /// Make a new random token; print it and its digest.
    Token,
    /// Make a private CA, a node certificate and a client certificate (PEM files
    /// ca.pem, node.pem, node.key, client.pem, client.key) in DIR.
    Ca {
        /// Folder to write them into (files there are not overwritten).
        dir: PathBuf,
        /// Names and IP addresses the node is reached by (repeat).
        #[arg(long = "host", default_values = ["localhost", "127.0.0.1"])]
        hosts: Vec<String>,
        /// The client certificate's subject common name (a tenant's `cert_subject`).
        #[arg(long, default_value = "client")]
        client: String,
    },
}

/// How a client command proves itself to nodes with tenants and checks TLS nodes.
#[derive(clap::Args, Clone)]
struct ClientCreds {
    /// Bearer token for a node with tenants (prefer the variable: flags show in `ps`).
    #[arg(long, env = "CSD_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// CA certificate (PEM) that `grpc+tls://` nodes' certificates chain to (default:
    /// the system's roots).
    #[arg(long, env = "CSD_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for nodes that require mutual TLS (with --tls-key).
    #[arg(long = "tls-cert", env = "CSD_CLIENT_CERT")]
    tls_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long = "tls-key", env = "CSD_CLIENT_KEY")]
    tls_key: Option<PathBuf>,
    /// Leases (ids from `csd lease`, of any of the nodes; comma-separated) that this
    /// command's pushed work runs on where a node holds one: it skips the node's
    /// queue.
    #[arg(
        long = "lease",
        id = "run_on_lease",
        value_name = "ID",
        env = "CSD_LEASE",
        value_delimiter = ','
    )]
    run_on_lease: Vec<String>,
}

impl ClientCreds {
    fn credentials(&self) -> Result<csd_runtime::node_client::Credentials> {
        let mut c = csd_runtime::node_client::Credentials::from_files(
            self.token.clone(),
            self.tls_ca.as_deref(),
            self.tls_cert.as_deref(),
            self.tls_key.as_deref(),
        )?;
        c.leases = self
            .run_on_lease
            .iter()
            .map(|l| l.trim().to_string())
            .filter(|l| !l.is_empty())
            .collect();
        Ok(c)
    }

    async fn connect(&self, url: &str) -> Result<NodeClient> {
        Ok(NodeClient::connect_with(url, &self.credentials()?).await?)
    }
}

#[derive(Subcommand)]
enum TestbedCmd {
    /// Run a scenario.
    Run {
        /// The scenario file.
        scenario: PathBuf,
        /// Report folder (default: `testbed-out/` and the scenario name).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Smaller data, shorter runs, two values per swept axis.
        #[arg(long)]
        quick: bool,
    },
    /// Check a scenario file and list the runs it would make.
    Check {
        /// The scenario file.
        scenario: PathBuf,
    },
}

#[derive(clap::Args)]
struct SqlArgs {
    /// Storage node URL (repeat for several nodes).
    #[arg(long = "node", default_value = "grpc://127.0.0.1:50051")]
    nodes: Vec<String>,
    /// Read everything to the compute tier and run the query here (the baseline).
    #[arg(long)]
    no_pushdown: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
    /// Compression of pushed-down answers: none, lz4 or zstd.
    #[arg(long, default_value = "lz4")]
    compression: String,
    /// Read the SQL from this file.
    #[arg(short = 'f', long = "file")]
    file: Option<PathBuf>,
    /// A SQL function computed by a WebAssembly module's export (repeatable): its
    /// calls are pushed to the nodes inside fragments like a built-in's.
    #[arg(long = "wasm-fn", value_name = "NAME=FILE.wasm:EXPORT")]
    wasm_fns: Vec<String>,
    /// Keep the answer at the nodes instead of printing it: prints one reference per
    /// partition on stdout, one JSON object a line (`{"location", "ticket",
    /// "expires"}`), for `csd get`, `csd release` or any Flight client's `DoGet`.
    /// The query must push whole (filters and projections over one table).
    #[arg(long, conflicts_with = "no_pushdown")]
    keep: bool,
    /// With --keep: how long the nodes keep it (e.g. 90s, 10m, 2h, 1d).
    #[arg(long, default_value = "10m", requires = "keep", value_parser = parse_ttl)]
    ttl: std::time::Duration,
    /// Run the plan's stages on these workers (`csd worker`; comma-separated
    /// `host:port` or `grpc://host:port`): this process plans and merges.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["no_pushdown", "keep"])]
    workers: Vec<String>,
    /// With --workers: the worker nearest a storage node, `NODE_URL=WORKER_URL`
    /// (repeatable; default: a worker on the node's host, else any).
    #[arg(long = "near", value_name = "NODE=WORKER", requires = "workers")]
    near: Vec<String>,
    /// The SQL (one or more statements separated by `;`).
    query: Option<String>,
    #[command(flatten)]
    creds: ClientCreds,
}

#[derive(clap::Args)]
struct WorkerArgs {
    /// Address to serve the worker on.
    #[arg(long, default_value = "127.0.0.1:50061", env = "CSD_WORKER_LISTEN")]
    listen: std::net::SocketAddr,
    /// Storage nodes to connect to at start-up (repeatable; others named by a plan
    /// are connected when first needed).
    #[arg(long = "node")]
    nodes: Vec<String>,
    /// Fragments handed back by the nodes that this worker evaluates at once
    /// (default: its cores).
    #[arg(long)]
    local_slots: Option<usize>,
    #[command(flatten)]
    creds: ClientCreds,
}

/// `90s`, `10m`, `2h`, `1d` or plain seconds.
fn parse_ttl(s: &str) -> std::result::Result<std::time::Duration, String> {
    let s = s.trim();
    let (n, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{s:?} is not a duration: use e.g. 90s, 10m, 2h or 1d"))?;
    let secs = match unit.trim() {
        "s" | "" => n,
        "m" | "min" => n * 60,
        "h" => n * 3600,
        "d" => n * 86_400,
        u => return Err(format!("unknown unit {u:?} in {s:?}: use s, m, h or d")),
    };
    if secs == 0 {
        return Err("a lifetime must be above zero".into());
    }
    Ok(std::time::Duration::from_secs(secs))
}

/// References given on the command line: JSON objects (one per argument, or one a
/// line from a file or `-` for stdin).
fn read_refs(args: &[String]) -> Result<Vec<csd_runtime::refs::Reference>> {
    let mut out = Vec::new();
    for a in args {
        let text = if a == "-" {
            std::io::read_to_string(std::io::stdin()).map_err(|e| Error::io("stdin", e))?
        } else if a.trim_start().starts_with('{') {
            a.clone()
        } else {
            std::fs::read_to_string(a).map_err(|e| Error::io(a, e))?
        };
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            out.push(csd_runtime::refs::Reference::parse(line)?);
        }
    }
    if out.is_empty() {
        return Err(Error::InvalidInput(
            "no reference given: pass the JSON `csd sql --keep` printed, a file of them, or - for stdin".into(),
        ));
    }
    Ok(out)
}

/// `NAME=FILE.wasm:EXPORT` (`:EXPORT` may be left out when it is NAME).
fn parse_wasm_fn(spec: &str) -> Result<(String, PathBuf, String)> {
    let bad = || {
        Error::InvalidInput(format!(
            "--wasm-fn {spec:?}: expected NAME=FILE.wasm:EXPORT (e.g. discounted=functions.wasm:discounted)"
        ))
    };
    let (name, rest) = spec.split_once('=').ok_or_else(bad)?;
    let (file, export) = match rest.rsplit_once(':') {
        Some((f, e)) if f.ends_with(".wasm") && !e.is_empty() => (f, e),
        _ if rest.ends_with(".wasm") => (rest, name),
        _ => return Err(bad()),
    };
    if name.is_empty() {
        return Err(bad());
    }
    Ok((name.to_string(), PathBuf::from(file), export.to_string()))
}

#[derive(clap::Args)]
struct RunArgs {
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
    /// Compression of the nodes' answers: none, lz4 or zstd.
    #[arg(long, default_value = "lz4")]
    compression: String,
    #[command(flatten)]
    creds: ClientCreds,
}

#[derive(clap::Args)]
struct FeaturesArgs {
    /// Storage node URL (repeat for several nodes).
    #[arg(long = "node", default_value = "grpc://127.0.0.1:50051")]
    nodes: Vec<String>,
    /// Dataset table (stored with `csd put --images` or `--text`).
    #[arg(long)]
    dataset: String,
    /// Model architecture.
    #[arg(long, default_value = "efficientnet-lite0")]
    model: String,
    /// Model weights (safetensors); uploaded to the nodes once, by content.
    #[arg(long)]
    weights: PathBuf,
    /// A text model's tokenizer.json (carried to the nodes inside the weights).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// auto (the planner's choice), N (stages [0, N) at the nodes), none, or full.
    #[arg(long, default_value = "auto")]
    split: String,
    /// Print the planner's candidate table.
    #[arg(long)]
    explain: bool,
    /// With --explain: only print the plan.
    #[arg(long)]
    dry_run: bool,
    /// Write `id, label, features` here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Training batch size (independent of the node's batch size).
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Send features as f16 (half the bytes).
    #[arg(long)]
    f16: bool,
    /// Compression of the node's answers: none, lz4 or zstd.
    #[arg(long, default_value = "lz4")]
    compression: String,
    /// Leave out samples that cannot be decoded (counted at the end) instead of
    /// failing on the first.
    #[arg(long)]
    skip_bad_samples: bool,
    /// Keep the nodes' output (the features before the split) at the nodes for
    /// --ttl and print a reference per partition on stderr (`kept {json}`), for
    /// later passes to read without running the node's stages again.
    #[arg(long)]
    keep: bool,
    /// With --keep: how long the nodes keep them (e.g. 10m, 2h).
    #[arg(long, default_value = "1h", requires = "keep", value_parser = parse_ttl)]
    ttl: std::time::Duration,
    #[command(flatten)]
    creds: ClientCreds,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Format {
    Table,
    Csv,
    Json,
}

#[derive(clap::Args)]
struct ServeArgs {
    /// TOML file with the same keys as the flags (`CSD_*` variables and flags win).
    #[arg(long, env = "CSD_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    node: NodeConfig,
}

/// Reads a Parquet or CSV file on a blocking thread, feeding a channel and a progress
/// bar (rows of the known total for Parquet; a row count for CSV).
fn read_file(
    path: PathBuf,
) -> Result<(
    SchemaRef,
    ProgressBar,
    tokio::sync::mpsc::Receiver<csd_runtime::node_client::Result<RecordBatch>>,
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
                csd_runtime::node_client::Error::InvalidInput(format!("{}: {e}", path.display()))
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

async fn serve(args: ServeArgs, matches: &clap::ArgMatches) -> Result<()> {
    let config = NodeConfig::load(matches, args.config.as_ref())?;
    let operators = csd_query_pushdown::registry_with(&config)?
        .with(Arc::new(csd_ml_pushdown::MlOperator::new()));
    let node = node::start_with(&config, operators).await?;
    announce(format_args!(
        "csd storage node listening on {} (device {})",
        node.url, config.device
    ));
    if let Some(m) = node.metrics_addr {
        announce(format_args!("metrics at http://{m}/metrics"));
    }
    let mut node = node;
    tokio::select! {
        r = tokio::signal::ctrl_c() => {
            r.map_err(|e| Error::io("waiting for Ctrl-C", e))?;
            announce(format_args!("shutting down"));
            node.shutdown().await?;
        }
        // The server ending on its own is an error worth reporting, not a hang.
        r = node.wait() => r?,
    }
    Ok(())
}

/// A server's status line on stdout. A launcher that read the address and closed
/// the pipe must not stop the server, so a write that fails is let go (`println!`
/// would panic on the broken pipe).
fn announce(line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = out
        .write_fmt(line)
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush());
}

async fn worker(args: WorkerArgs) -> Result<()> {
    let env = csd_query_pushdown::WorkerEnv::new(args.creds.credentials()?, args.local_slots)?;
    env.connect(&args.nodes).await?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| Error::io(format!("binding {}", args.listen), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::io("the worker's address", e))?;
    announce(format_args!("csd worker listening on grpc://{addr}"));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| Error::io("waiting for SIGTERM", e))?;
    let stop = async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    };
    csd_query_pushdown::serve_worker_on(env, listener, stop).await?;
    Ok(())
}

async fn run_wasm(args: RunArgs) -> Result<()> {
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
    Ok(())
}

/// A file of batches opened on the first one: Arrow IPC or Parquet by extension.
#[derive(Default)]
enum BatchFile {
    #[default]
    Closed,
    Ipc(
        arrow::ipc::writer::FileWriter<std::io::BufWriter<std::fs::File>>,
        usize,
    ),
    Parquet(
        parquet::arrow::ArrowWriter<std::io::BufWriter<std::fs::File>>,
        usize,
    ),
}

impl BatchFile {
    fn write(&mut self, path: &Path, b: &arrow::record_batch::RecordBatch) -> Result<()> {
        let io = |e: std::io::Error| Error::io(format!("writing {}", path.display()), e);
        if let BatchFile::Closed = self {
            let f = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
            let ipc = matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("arrow" | "ipc" | "feather")
            );
            *self = if ipc {
                BatchFile::Ipc(arrow::ipc::writer::FileWriter::try_new(f, &b.schema())?, 0)
            } else {
                BatchFile::Parquet(
                    parquet::arrow::ArrowWriter::try_new(f, b.schema(), None)
                        .map_err(|e| Error::InvalidInput(format!("{}: {e}", path.display())))?,
                    0,
                )
            };
        }
        match self {
            BatchFile::Ipc(w, n) => {
                w.write(b)?;
                *n += b.num_rows();
            }
            BatchFile::Parquet(w, n) => {
                w.write(b)
                    .map_err(|e| Error::InvalidInput(format!("{}: {e}", path.display())))?;
                *n += b.num_rows();
            }
            BatchFile::Closed => {}
        }
        Ok(())
    }

    /// Closes the file; the rows written.
    fn finish(self) -> Result<usize> {
        Ok(match self {
            BatchFile::Closed => 0,
            BatchFile::Ipc(mut w, n) => {
                w.finish()?;
                n
            }
            BatchFile::Parquet(w, n) => {
                w.close()
                    .map_err(|e| Error::InvalidInput(format!("closing the Parquet file: {e}")))?;
                n
            }
        })
    }
}

fn print_batches(batches: &[arrow::record_batch::RecordBatch], format: Format) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let io = |e: std::io::Error| Error::io("writing the result", e);
    match format {
        Format::Table => writeln!(
            out,
            "{}",
            arrow::util::pretty::pretty_format_batches(batches)?
        )
        .map_err(io)?,
        Format::Csv => {
            let mut w = arrow::csv::WriterBuilder::new()
                .with_header(true)
                .build(&mut out);
            for b in batches {
                w.write(b)?;
            }
        }
        Format::Json => {
            let mut w = arrow::json::LineDelimitedWriter::new(&mut out);
            for b in batches {
                w.write(b)?;
            }
            w.finish()?;
        }
    }
    Ok(())
}

async fn run_sql(
    session: &csd_query_pushdown::CsdSession,
    sql: &str,
    format: Format,
) -> Result<()> {
    let r = session.run(sql).await?;
    print_batches(&r.batches, format)?;
    let scanned: u64 = r.node_runs.iter().map(|n| n.report.bytes_read).sum();
    // Time at the nodes less time queued there: what their engines spent.
    let node_ms: f64 = r
        .node_runs
        .iter()
        .map(|n| {
            let queued = n.report.admission.queue_ms;
            (n.report.elapsed_us as f64 / 1e3 - queued).max(0.0)
        })
        .sum();
    let handed_back = r.node_runs.iter().filter(|n| n.work_pushed_back()).count();
    let leased = r
        .node_runs
        .iter()
        .filter(|n| n.report.admission.lease.is_some())
        .count();
    eprintln!(
        "{} rows in {:.1} ms; {} bytes moved from the nodes{}",
        r.rows(),
        r.elapsed.as_secs_f64() * 1e3,
        r.bytes_moved,
        if !session.workers().is_empty() {
            format!(
                " (pushdown, stages on {} workers{})",
                session.workers().len(),
                if r.metrics_complete {
                    ""
                } else {
                    "; at least: some planned tasks never ran, so the workers sent no counts"
                }
            )
        } else if session.pushdown() {
            format!(
                " (pushdown: nodes read {scanned} bytes from their devices; {} fragments, {node_ms:.1} ms run at the nodes in all, {handed_back} handed back{})",
                r.node_runs.len(),
                if leased > 0 {
                    format!(", {leased} on leases")
                } else {
                    String::new()
                }
            )
        } else {
            " (no pushdown: Parquet byte ranges)".to_string()
        }
    );
    Ok(())
}

async fn sql(args: SqlArgs) -> Result<()> {
    let cluster =
        csd_query_pushdown::Cluster::connect_with(&args.nodes, &args.creds.credentials()?).await?;
    let opts = csd_query_pushdown::SessionOptions {
        pushdown: !args.no_pushdown,
        compression: args.compression.parse()?,
        ..Default::default()
    };
    let session = if args.workers.is_empty() {
        cluster.session(opts).await?
    } else {
        let mut workers = csd_query_pushdown::Workers::new(args.workers.iter().cloned());
        for n in &args.near {
            let (node, worker) = n.split_once('=').ok_or_else(|| {
                Error::InvalidInput(format!("--near {n:?}: write NODE_URL=WORKER_URL"))
            })?;
            workers
                .locality
                .insert(node.to_string(), worker.to_string());
        }
        cluster.distributed_session(opts, &workers).await?
    };
    for spec in &args.wasm_fns {
        let (name, file, export) = parse_wasm_fn(spec)?;
        let module = std::fs::read(&file).map_err(|e| Error::io(file.display(), e))?;
        session.register_wasm_udf(&name, &module, &export).await?;
    }
    let script = match (&args.query, &args.file) {
        (Some(_), Some(_)) => {
            return Err(Error::InvalidInput(
                "give a query or -f FILE, not both".into(),
            ));
        }
        (Some(q), None) => Some(q.clone()),
        (None, Some(f)) => Some(std::fs::read_to_string(f).map_err(|e| Error::io(f.display(), e))?),
        (None, None) => None,
    };
    if args.keep {
        let script = script.ok_or_else(|| {
            Error::InvalidInput("--keep needs the query as an argument or in -f FILE".into())
        })?;
        let statements = statements(&script)?;
        let [query] = statements.as_slice() else {
            return Err(Error::InvalidInput(format!(
                "--keep keeps the answer of one query; {} statements were given",
                statements.len()
            )));
        };
        let started = std::time::Instant::now();
        let kept = session.keep(query, args.ttl).await?;
        for k in &kept {
            println!(
                "{}",
                serde_json::to_string(&k.reference).unwrap_or_default()
            );
        }
        eprintln!(
            "kept {} rows ({} bytes) at the nodes in {} reference(s), in {:.1} ms{}",
            kept.iter().map(|k| k.rows).sum::<u64>(),
            kept.iter().map(|k| k.bytes).sum::<u64>(),
            kept.len(),
            started.elapsed().as_secs_f64() * 1e3,
            kept.first()
                .map(|k| format!(
                    "; the next query reads them at the nodes as table {}",
                    k.reference.table
                ))
                .unwrap_or_default()
        );
        return Ok(());
    }
    if let Some(script) = script {
        for s in statements(&script)? {
            run_sql(&session, &s, args.format).await?;
        }
        return Ok(());
    }
    // Interactive: statements end with `;`; errors are printed and the prompt goes on.
    use std::io::{BufRead, IsTerminal, Write};
    let tty = std::io::stdin().is_terminal();
    let mut pending = String::new();
    let mut lines = std::io::stdin().lock().lines();
    loop {
        if tty {
            eprint!("{}", if pending.is_empty() { "csd> " } else { "  -> " });
            let _ = std::io::stderr().flush();
        }
        let Some(line) = lines.next() else { break };
        let line = line.map_err(|e| Error::io("reading stdin", e))?;
        pending.push_str(&line);
        pending.push('\n');
        // Run what a `;` ended; a text the tokenizer cannot read yet (an open quote)
        // waits for more lines.
        let Ok((done, rest)) = split_statements(&pending) else {
            continue;
        };
        for s in done {
            if let Err(e) = run_sql(&session, &s, args.format).await {
                if !tty {
                    return Err(e);
                }
                eprintln!("error: {e}");
            }
        }
        pending = if rest.is_empty() {
            String::new()
        } else {
            rest + "\n"
        };
    }
    for s in statements(&pending)? {
        run_sql(&session, &s, args.format).await?;
    }
    Ok(())
}

async fn run(cli: Cli, matches: &clap::ArgMatches) -> Result<()> {
    match cli.command {
        Command::Serve(args) => {
            let serve_matches = matches
                .subcommand_matches("serve")
                .ok_or_else(|| Error::InvalidInput("serve: no arguments parsed".into()))?;
            serve(args, serve_matches).await
        }
        Command::Sql(args) => sql(args).await,
        Command::Worker(args) => worker(args).await,
        Command::Run(args) => run_wasm(args).await,
        Command::Features(args) => features(args).await,
        Command::Put {
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
        } if images.is_some() || text.is_some() => {
            let mut clients = Vec::new();
            for n in &nodes {
                clients.push(creds.connect(n).await?);
            }
            let what = if images.is_some() { "images" } else { "texts" };
            let bar = ProgressBar::new_spinner().with_style(
                ProgressStyle::with_template(&format!(
                    "{{spinner}} storing {{pos}} {what} {{per_sec}}"
                ))
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
        Command::Put {
            file,
            table,
            partition,
            nodes,
            creds,
            ..
        } => {
            let file = file.ok_or_else(|| {
                Error::InvalidInput("give a file, --images DIR or --text FILE".into())
            })?;
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
        Command::Ls {
            node,
            objects,
            creds,
        } => {
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
            for t in &tables {
                println!(
                    "{:<w$} {:>12} {:>14} {:>10}",
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
        Command::Rm {
            target,
            node,
            creds,
        } => {
            let (table, partition) = match target.split_once('/') {
                Some((t, p)) => (t, Some(p)),
                None => (target.as_str(), None),
            };
            let n = creds.connect(&node).await?.delete(table, partition).await?;
            println!("deleted {target} ({n} objects)");
            Ok(())
        }
        Command::Get {
            refs,
            format,
            out,
            creds,
        } => {
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
        Command::Refs { node, creds } => {
            for r in creds.connect(&node).await?.refs().await? {
                println!("{}", serde_json::to_string(&r).unwrap_or_default());
            }
            Ok(())
        }
        Command::Release { refs, node, creds } => {
            for r in read_refs(&refs)? {
                let at = node.clone().unwrap_or_else(|| r.location.clone());
                let info = creds.connect(&at).await?.release(&r).await?;
                eprintln!(
                    "released {} ({} rows, {} bytes)",
                    info.id, info.rows, info.bytes
                );
            }
            Ok(())
        }
        Command::Grant {
            refs,
            to,
            revoke,
            creds,
        } => {
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
        Command::Renew { refs, ttl, creds } => {
            for r in read_refs(&refs)? {
                let renewed = creds.connect(&r.location).await?.renew(&r, ttl).await?;
                println!("{}", serde_json::to_string(&renewed).unwrap_or_default());
            }
            Ok(())
        }
        Command::Lease {
            node,
            slots,
            seconds,
            release,
            hold,
            idle_s,
            memory,
            creds,
        } => {
            let c = creds.connect(&node).await?;
            if release.is_none() && (!seconds.is_finite() || seconds <= 0.0) {
                return Err(Error::InvalidInput(format!(
                    "--seconds {seconds}: a lease lasts a positive number of seconds"
                )));
            }
            let ask = csd_runtime::protocol::LeaseRequest {
                slots,
                seconds,
                idle_seconds: None,
                memory,
            };
            if hold {
                if !idle_s.is_finite() || idle_s <= 0.0 {
                    return Err(Error::InvalidInput(
                        "--idle-s must be a positive number of seconds".into(),
                    ));
                }
                let held = c
                    .hold_lease_with(&csd_runtime::protocol::LeaseRequest {
                        idle_seconds: Some(idle_s),
                        ..ask
                    })
                    .await?;
                println!("{}", serde_json::to_string(&held.info).unwrap_or_default());
                eprintln!("holding lease {} (Ctrl-C ends it)", held.info.id);
                let _ = tokio::signal::ctrl_c().await;
                let id = held.info.id.clone();
                drop(held);
                c.release_lease(&id).await?;
                return Ok(());
            }
            let info = match release {
                Some(id) => c.release_lease(&id).await?,
                None => c.lease_with(&ask).await?,
            };
            println!("{}", serde_json::to_string(&info).unwrap_or_default());
            Ok(())
        }
        Command::Invoke {
            lease,
            node,
            wasm,
            export,
            input,
            format,
            creds,
        } => {
            let module = std::fs::read(&wasm).map_err(|e| Error::io(wasm.display(), e))?;
            let bytes = std::fs::read(&input).map_err(|e| Error::io(input.display(), e))?;
            let batches: Vec<arrow::record_batch::RecordBatch> =
                match arrow::ipc::reader::FileReader::try_new(std::io::Cursor::new(&bytes), None) {
                    Ok(r) => r.collect::<std::result::Result<_, _>>(),
                    Err(_) => arrow::ipc::reader::StreamReader::try_new(
                        std::io::Cursor::new(&bytes),
                        None,
                    )
                    .and_then(|r| r.collect()),
                }
                .map_err(|e| {
                    Error::InvalidInput(format!(
                        "{}: not an Arrow IPC file or stream: {e}",
                        input.display()
                    ))
                })?;
            let c = creds.connect(&node).await?;
            let digest = csd_runtime::sandbox::ModuleDigest::of(&module);
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
        Command::Stats { node, creds } => {
            let s = creds.connect(&node).await?.stats().await?;
            println!("{}", serde_json::to_string_pretty(&s).unwrap_or_default());
            Ok(())
        }
        Command::Auth(cmd) => auth(cmd),
        Command::Testbed(cmd) => testbed(cmd).await,
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
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if !matches!(
        cli.command,
        Command::Serve(_) | Command::Demo { .. } | Command::Testbed(_)
    ) {
        // Pure client commands behave like other Unix tools under `csd ls | head`: end
        // quietly on a closed pipe instead of panicking in println!. Not where a node is
        // hosted: a peer closing its socket would then kill the node.
        // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
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
    match rt.block_on(run(cli, &matches)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("csd: {}", csd_runtime::error::chain(&e));
            std::process::ExitCode::from(e.exit_code())
        }
    }
}

fn auth(cmd: AuthCmd) -> Result<()> {
    use csd_runtime::auth::{new_token, token_digest};
    match cmd {
        AuthCmd::Hash { token } => {
            let token = match token {
                Some(t) => t,
                None => {
                    let mut line = String::new();
                    std::io::stdin()
                        .read_line(&mut line)
                        .map_err(|e| Error::io("reading the token from stdin", e))?;
                    line.trim().to_string()
                }
            };
            if token.is_empty() {
                return Err(Error::InvalidInput("the token is empty".into()));
            }
            println!("{}", token_digest(&token));
        }
        AuthCmd::Token => {
            let t = new_token();
            println!("token:        {t}");
            println!("token_sha256: {}", token_digest(&t));
        }
        AuthCmd::Ca { dir, hosts, client } => {
            let certs = csd_runtime::tls::make_certificates(&hosts, &client)?;
            for p in certs.write(&dir)? {
                println!("wrote {}", p.display());
            }
            println!(
                "node:   csd serve --tls-cert {0}/node.pem --tls-key {0}/node.key [--tls-client-ca {0}/ca.pem]",
                dir.display()
            );
            println!(
                "client: csd ls --node grpc+tls://{}:50051 --tls-ca {1}/ca.pem [--tls-cert {1}/client.pem --tls-key {1}/client.key]",
                hosts.first().map(String::as_str).unwrap_or("localhost"),
                dir.display()
            );
        }
    }
    Ok(())
}

async fn testbed(cmd: TestbedCmd) -> Result<()> {
    use csd_testbed::scenario::{Scenario, label};
    match cmd {
        TestbedCmd::Check { scenario } => {
            let s = Scenario::from_file(&scenario)?;
            let points = s.points();
            println!(
                "{}: {} policies × {} points = {} runs, each stopped after {} s",
                s.name,
                s.policies.len(),
                points.len(),
                s.policies.len() * points.len(),
                s.timeout_s
            );
            for p in &points {
                println!("  {}", label(p));
            }
            Ok(())
        }
        TestbedCmd::Run {
            scenario,
            out,
            quick,
        } => {
            let s = Scenario::from_file(&scenario)?;
            let out = out.unwrap_or_else(|| PathBuf::from("testbed-out").join(&s.name));
            let opts = csd_testbed::RunOptions {
                out: out.clone(),
                quick,
                progress: true,
            };
            let report = csd_testbed::run(s, &opts).await?;
            println!("\n{}", report.headline.join("\n"));
            println!("report: {}", out.join("report.md").display());
            Ok(())
        }
    }
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

async fn features(args: FeaturesArgs) -> Result<()> {
    use csd_client::features::{FeaturesOptions, SplitChoice, features, received, write_parquet};
    let arch: csd_ml_pushdown::Arch = args.model.parse().map_err(Error::Ml)?;
    let split: SplitChoice = args.split.parse()?;
    let mut weights =
        std::fs::read(&args.weights).map_err(|e| Error::io(args.weights.display(), e))?;
    if let Some(t) = &args.tokenizer {
        let json = std::fs::read(t).map_err(|e| Error::io(t.display(), e))?;
        weights = csd_ml_pushdown::weights::with_tokenizer(&weights, &json)?;
    }
    let mut clients = Vec::new();
    for n in &args.nodes {
        clients.push(args.creds.connect(n).await?);
    }
    let opts = FeaturesOptions {
        dataset: args.dataset.clone(),
        arch,
        split,
        train_batch: args.batch,
        dtype: if args.f16 {
            csd_ml_pushdown::request::FeatureType::F16
        } else {
            csd_ml_pushdown::request::FeatureType::F32
        },
        compression: args.compression.parse()?,
        pool: None,
        skip_bad_samples: args.skip_bad_samples,
        keep: args
            .keep
            .then(|| csd_ml_pushdown::stream::KeepFeatures::new(args.ttl)),
    };
    let started = std::time::Instant::now();
    let (stream, run) = features(&clients, &weights, &opts, args.explain).await?;
    if let Some(p) = &run.plan
        && args.explain
    {
        print!("{}", p.explain());
        if args.dry_run {
            return Ok(());
        }
    }
    let bar = ProgressBar::new_spinner().with_style(
        ProgressStyle::with_template("{spinner} {pos} samples {per_sec}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    let rows = write_parquet(stream, args.out.as_deref(), &bar).await?;
    bar.finish_and_clear();
    let relaxed = std::sync::atomic::Ordering::Relaxed;
    eprintln!(
        "{rows} samples through {arch} with split {} in {:.2} s; {} bytes received; {} partitions pushed back; {} undecodable samples skipped",
        run.split,
        started.elapsed().as_secs_f64(),
        received(&run.stats),
        run.stats.pushed_back.load(relaxed),
        run.stats.skipped.load(relaxed),
    );
    if let Some(k) = &opts.keep {
        for r in k.references() {
            eprintln!("kept {}", serde_json::to_string(&r).unwrap_or_default());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// Clap checks a command's arguments only when that (sub)command is built: each
    /// one is checked here (a flag clashing with another, as `--lease` once did with
    /// `invoke`'s lease argument, would otherwise panic when a user runs it).
    #[test]
    fn every_command_line_is_well_formed() {
        use clap::CommandFactory;
        fn check(c: &clap::Command) {
            c.clone().debug_assert();
            for s in c.get_subcommands() {
                check(s);
            }
        }
        check(&super::Cli::command());
    }
}
