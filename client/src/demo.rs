//! The README's main job: an embedded storage node on a file-backed device, TPC-H
//! generated and stored through Flight, then a few queries run with pushdown and
//! without (DataFusion reading the node's Parquet by byte range), checked equal, with
//! time and bytes moved side by side.

use std::time::Instant;

use csd_query_pushdown::{Cluster, SessionOptions};
use csd_runtime::config::{ByteSize, NodeConfig};
use csd_runtime::node;
use csd_testbed::tpch;
use indicatif::{ProgressBar, ProgressStyle};

use crate::{Error, NodeClient, Result};

/// Demo settings.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// TPC-H scale factor.
    pub scale: f64,
    /// Partitions per table.
    pub partitions: usize,
    /// Device spec; default: an io_uring file in the temp directory.
    pub device: Option<String>,
    /// Keep the device file afterwards.
    pub keep: bool,
    /// TPC-H queries to run.
    pub queries: Vec<u32>,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            scale: 0.1,
            partitions: 4,
            device: None,
            keep: false,
            queries: vec![1, 6, 12, 14, 19, 3],
        }
    }
}

/// Prints a line; a closed stdout (`csd demo | head`) is not an error worth a panic.
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

/// Generates TPC-H `lineitem` part `part` (1-based) of `parts` at `scale`.
pub fn lineitem(
    scale: f64,
    part: i32,
    parts: i32,
) -> Result<Vec<arrow::record_batch::RecordBatch>> {
    Ok(tpch::generate("lineitem", scale, part, parts)?.1)
}

/// A linked structure for the pointer chase: `CSDCHAIN`, `n` (u64), then `n` records
/// of 16 bytes, (index of the next record, value) as little-endian u64; the links
/// follow a xorshift sequence from `seed`.
pub fn chain(n: u64, seed: u64) -> Vec<u8> {
    let mut out = b"CSDCHAIN".to_vec();
    out.extend_from_slice(&n.to_le_bytes());
    let mut x = seed | 1;
    for i in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&(x % n.max(1)).to_le_bytes());
        out.extend_from_slice(&(i * 3 + 1).to_le_bytes());
    }
    out
}

/// Stores `chain` at `c` as table `chain` (one row: `id`, `data` binary) and returns
/// the object holding it and the byte offset of record 0 in that object (found once,
/// as a client of RDMA memory knows a remote address).
pub async fn put_chain(c: &NodeClient, chain: &[u8]) -> Result<(String, u64)> {
    use std::sync::Arc;

    use arrow::datatypes::{DataType, Field, Schema};
    use futures::StreamExt;
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("data", DataType::Binary, false),
    ]));
    let batch = arrow::record_batch::RecordBatch::try_new(
        schema.clone(),
        vec![
            Arc::new(arrow::array::Int64Array::from(vec![0])),
            Arc::new(arrow::array::BinaryArray::from(vec![chain])),
        ],
    )?;
    c.put(
        "chain",
        "0",
        schema,
        futures::stream::iter([Ok(batch)]).boxed(),
    )
    .await?;
    let t = c.table("chain").await?;
    let o = t
        .description
        .partitions
        .first()
        .and_then(|p| p.objects.first())
        .ok_or_else(|| Error::InvalidInput("table chain has no object".into()))?;
    let bytes = c.read_range(&o.name, 0, o.len).await?;
    let head = chain.get(..16).unwrap_or(chain);
    let at = memchr::memmem::find(&bytes, head).ok_or_else(|| {
        Error::InvalidInput(format!(
            "the chain is not stored as plain bytes in {} (is --parquet-compression on?)",
            o.name
        ))
    })?;
    Ok((o.name.clone(), at as u64 + 16))
}

/// Runs the demo, printing what happens.
pub async fn run(opts: DemoOptions) -> Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("csd-demo")
        .tempdir_in(std::env::temp_dir())
        .map_err(|e| Error::io("creating a temporary directory", e))?;
    let default_device = dir.path().join("device.img").display().to_string();
    let mut config = NodeConfig {
        device: opts.device.clone().unwrap_or(default_device.clone()),
        capacity: ByteSize::gib(4),
        listen: "127.0.0.1:0".into(),
        format: true,
        ..NodeConfig::default()
    };
    let node = match node::start_with(&config, csd_query_pushdown::registry()).await {
        Err(csd_runtime::Error::Unavailable(why)) if opts.device.is_none() => {
            say!(
                "io_uring device unavailable ({why});\nfalling back to the emulated NVMe backend on the same file"
            );
            config.device = format!("emulated:file={default_device}");
            node::start_with(&config, csd_query_pushdown::registry()).await?
        }
        other => other?,
    };
    let stats = node.state.stats().await;
    say!(
        "storage node   {}  device {} ({:.0} MB), {} CPU workers",
        node.url,
        stats.device.geometry.name,
        mb(stats.device.geometry.capacity()),
        stats.cpus
    );
    let client = NodeClient::connect(&node.url).await?;

    // Generate and store all eight tables.
    let t0 = Instant::now();
    let bar = ProgressBar::new_spinner().with_style(
        ProgressStyle::with_template("loading        {spinner} {msg} {pos} rows {per_sec}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    tpch::load(
        std::slice::from_ref(&client),
        opts.scale,
        opts.partitions,
        |t, rows| {
            bar.set_message(t.to_string());
            bar.inc(rows);
        },
    )
    .await?;
    bar.finish_and_clear();
    let tables = client.list_tables("").await?;
    let rows: u64 = tables.iter().map(|t| t.rows).sum();
    let bytes: u64 = tables.iter().map(|t| t.bytes).sum();
    say!(
        "loaded         TPC-H SF {}: {} tables, {rows} rows, {:.1} MB of Parquet on the device, in {:.2?}",
        opts.scale,
        tables.len(),
        mb(bytes),
        t0.elapsed()
    );

    let cluster = Cluster::connect(std::slice::from_ref(&node.url)).await?;
    let on = cluster.session(SessionOptions::default()).await?;
    let off = cluster
        .session(SessionOptions {
            pushdown: false,
            ..SessionOptions::default()
        })
        .await?;
    say!(
        "\n{:<6} {:>6} {:>13} {:>13} {:>13} {:>13} {:>9}",
        "query",
        "rows",
        "pushdown ms",
        "no-push ms",
        "pushdown MB",
        "no-push MB",
        "saved"
    );
    let (mut moved_on, mut moved_off) = (0u64, 0u64);
    for q in &opts.queries {
        let sql = tpch::query(*q)
            .ok_or_else(|| Error::InvalidInput(format!("there is no TPC-H query {q}")))?;
        // Warm footers and connections for both, then measure.
        on.run(sql).await?;
        off.run(sql).await?;
        let a = on.run(sql).await?;
        let b = off.run(sql).await?;
        let text = |r: &csd_query_pushdown::QueryRun| -> Result<String> {
            Ok(arrow::util::pretty::pretty_format_batches(&r.batches)?.to_string())
        };
        if text(&a)? != text(&b)? {
            return Err(Error::Runtime(csd_runtime::Error::Internal(format!(
                "Q{q} answered differently with and without pushdown"
            ))));
        }
        moved_on += a.bytes_moved;
        moved_off += b.bytes_moved;
        say!(
            "Q{:<5} {:>6} {:>13.1} {:>13.1} {:>13.3} {:>13.3} {:>8.1}x",
            q,
            a.rows(),
            a.elapsed.as_secs_f64() * 1e3,
            b.elapsed.as_secs_f64() * 1e3,
            mb(a.bytes_moved),
            mb(b.bytes_moved),
            b.bytes_moved as f64 / a.bytes_moved.max(1) as f64
        );
    }
    say!(
        "\nsame answers with and without pushdown; pushdown moved {:.2} MB instead of {:.2} MB ({:.1}x fewer bytes)",
        mb(moved_on),
        mb(moved_off),
        moved_off as f64 / moved_on.max(1) as f64
    );
    drop((on, off, cluster, client));
    node.shutdown().await?;
    match (&opts.device, opts.keep) {
        // The user's own device stays where it is; the scratch folder goes.
        (Some(d), true) => say!("kept           device {d} (csd serve --device {d})"),
        (Some(_), false) => {}
        (None, true) => {
            let kept = dir.keep();
            say!("kept           device in {}", kept.display());
        }
        (None, false) => {}
    }
    Ok(())
}
