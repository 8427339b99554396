//! `csd sql`: SQL over the nodes' tables, the data-reducing part pushed to the nodes
//! (a query, a script, stdin or a prompt; `--keep` keeps the answer at the nodes).

use std::path::PathBuf;

use csd_client::script::{split_statements, statements};
use csd_client::{Error, Result};
use csd_protocol::node_client::Tried;

use super::{ClientCreds, Format, parse_ttl, print_batches};

#[derive(clap::Args)]
pub(crate) struct SqlArgs {
    /// Storage node URL (repeat for several nodes).
    #[arg(long = "node", default_value = "grpc://127.0.0.1:50051")]
    nodes: Vec<String>,
    /// Read everything to the compute tier and run the query here (the baseline).
    #[arg(long)]
    no_pushdown: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
    /// Compression of pushed-down answers: auto (LZ4, and zstd for the pieces the link
    /// holds back), none, lz4 or zstd.
    #[arg(long, default_value = "auto")]
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
    // Why each node returned work it was asked to do (the compute tier did it).
    for n in r.node_runs.iter().filter(|n| n.work_pushed_back()) {
        if let Some(why) = &n.pushed_back {
            eprintln!("{} returned its fragment: {}", n.endpoint, why.reason());
        }
    }
    // Which copy of a partition ran its fragment when the one asked first did not.
    for n in r.node_runs.iter().filter(|n| !n.failed_over.is_empty()) {
        let ran = match n.pushed_back.is_some() {
            true => "none of its copies ran it",
            false => "ran it",
        };
        eprintln!(
            "{}: {ran}, after {}",
            n.endpoint,
            Tried::list(&n.failed_over)
        );
    }
    Ok(())
}

pub(crate) async fn run(args: SqlArgs) -> Result<()> {
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
