//! The `csd` commands, one module each (its arguments and its `run`), and what
//! several of them share: credentials, output formats, references on the command
//! line.

pub(crate) mod auth;
pub(crate) mod demo;
pub(crate) mod features;
pub(crate) mod gateway;
pub(crate) mod get;
pub(crate) mod grant;
pub(crate) mod invoke;
pub(crate) mod lease;
pub(crate) mod ls;
pub(crate) mod put;
pub(crate) mod put_copies;
pub(crate) mod put_file;
pub(crate) mod refs;
pub(crate) mod release;
pub(crate) mod renew;
pub(crate) mod repair;
pub(crate) mod rm;
pub(crate) mod run;
pub(crate) mod scrub;
pub(crate) mod serve;
pub(crate) mod sql;
pub(crate) mod stats;
pub(crate) mod testbed;
pub(crate) mod worker;

use std::path::{Path, PathBuf};

use csd_client::{Error, NodeClient, Result};

/// How a client command proves itself to nodes with tenants and checks TLS nodes.
#[derive(clap::Args, Clone)]
pub(crate) struct ClientCreds {
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
    pub(crate) fn credentials(&self) -> Result<csd_protocol::node_client::Credentials> {
        let mut c = csd_protocol::node_client::Credentials::from_files(
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

    pub(crate) async fn connect(&self, url: &str) -> Result<NodeClient> {
        Ok(NodeClient::connect_with(url, &self.credentials()?).await?)
    }
}

/// Resolves on Ctrl-C or SIGTERM: when a long-running command (`csd worker`, `csd
/// gateway`) stops serving.
pub(crate) fn stop_signal() -> Result<impl std::future::Future<Output = ()> + Send + 'static> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| Error::io("waiting for SIGTERM", e))?;
    Ok(async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    })
}

/// `90s`, `10m`, `2h`, `1d` or plain seconds.
pub(crate) fn parse_ttl(s: &str) -> std::result::Result<std::time::Duration, String> {
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
pub(crate) fn read_refs(args: &[String]) -> Result<Vec<csd_protocol::refs::Reference>> {
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
            out.push(csd_protocol::refs::Reference::parse(line)?);
        }
    }
    if out.is_empty() {
        return Err(Error::InvalidInput(
            "no reference given: pass the JSON `csd sql --keep` printed, a file of them, or - for stdin".into(),
        ));
    }
    Ok(out)
}

/// How a command prints rows.
#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum Format {
    Table,
    Csv,
    Json,
}

/// A server's status line on stdout. A launcher that read the address and closed
/// the pipe must not stop the server, so a write that fails is let go (`println!`
/// would panic on the broken pipe).
pub(crate) fn announce(line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = out
        .write_fmt(line)
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush());
}

/// A file of batches opened on the first one: Arrow IPC or Parquet by extension.
#[derive(Default)]
pub(crate) enum BatchFile {
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
    pub(crate) fn write(
        &mut self,
        path: &Path,
        b: &arrow::record_batch::RecordBatch,
    ) -> Result<()> {
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
    pub(crate) fn finish(self) -> Result<usize> {
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

pub(crate) fn print_batches(
    batches: &[arrow::record_batch::RecordBatch],
    format: Format,
) -> Result<()> {
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
