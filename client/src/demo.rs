//! The README's main job: an embedded storage node on a file-backed device, a
//! generated TPC-H `lineitem` table stored through Flight, read back and checked.

use std::time::Instant;

use arrow::compute::concat_batches;
use arrow::record_batch::RecordBatch;
use csd_runtime::node::{self, NodeConfig};
use futures::{StreamExt, TryStreamExt};
use indicatif::{ProgressBar, ProgressStyle};
use tpchgen::generators::LineItemGenerator;
use tpchgen_arrow::LineItemArrow;

use crate::{Error, NodeClient, Result};

/// Demo settings.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// TPC-H scale factor.
    pub scale: f64,
    /// Partitions to split the table into.
    pub partitions: i32,
    /// Device spec; default: an io_uring file in the temp directory.
    pub device: Option<String>,
    /// Keep the device file afterwards.
    pub keep: bool,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            scale: 0.1,
            partitions: 4,
            device: None,
            keep: false,
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

/// Generates TPC-H `lineitem` part `part` of `parts` at `scale`.
pub fn lineitem(scale: f64, part: i32, parts: i32) -> Result<Vec<RecordBatch>> {
    Ok(
        LineItemArrow::new(LineItemGenerator::new(scale, part, parts))
            .with_batch_size(8192)
            .collect::<Result<_, _>>()?,
    )
}

/// Runs the demo, printing what happens.
pub async fn run(opts: DemoOptions) -> Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("csd-demo")
        .tempdir_in(std::env::temp_dir())
        .map_err(|e| Error::InvalidInput(e.to_string()))?;
    let default_device = dir.path().join("device.img").display().to_string();
    let mut config = NodeConfig {
        device: opts.device.clone().unwrap_or(default_device.clone()),
        capacity: Some("2GiB".into()),
        listen: "127.0.0.1:0".into(),
        format: true,
        ..NodeConfig::default()
    };
    let node = match node::start(&config).await {
        Err(csd_runtime::Error::Unavailable(why)) if opts.device.is_none() => {
            say!(
                "io_uring device unavailable ({why});\nfalling back to the emulated NVMe backend on the same file"
            );
            config.device = format!("emulated:file={default_device}");
            node::start(&config).await?
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

    // Generate and store.
    let t0 = Instant::now();
    let parts: Vec<Vec<RecordBatch>> = (1..=opts.partitions)
        .map(|p| lineitem(opts.scale, p, opts.partitions))
        .collect::<Result<_>>()?;
    let rows: usize = parts.iter().flatten().map(|b| b.num_rows()).sum();
    let arrow_bytes: usize = parts
        .iter()
        .flatten()
        .map(|b| b.get_array_memory_size())
        .sum();
    say!(
        "generated      TPC-H lineitem SF {}: {rows} rows, {:.1} MB in Arrow, in {:.2?}",
        opts.scale,
        mb(arrow_bytes as u64),
        t0.elapsed()
    );
    let bar = ProgressBar::new(rows as u64).with_style(
        ProgressStyle::with_template("storing        [{bar:30}] {pos}/{len} rows {per_sec}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let t0 = Instant::now();
    let mut stored = 0u64;
    for (i, batches) in parts.iter().enumerate() {
        let schema = batches[0].schema();
        let b2 = bar.clone();
        let stream = futures::stream::iter(batches.clone()).map(move |b| {
            b2.inc(b.num_rows() as u64);
            Ok(b)
        });
        let s = client
            .put("lineitem", &format!("p{i}"), schema, stream)
            .await?;
        stored += s.bytes;
    }
    bar.finish_and_clear();
    let put_time = t0.elapsed();
    say!(
        "stored         {rows} rows as {} Parquet partitions: {:.1} MB on the device ({:.1}x smaller than Arrow), {:.2?} ({:.0} MB/s of Arrow)",
        opts.partitions,
        mb(stored),
        arrow_bytes as f64 / stored as f64,
        put_time,
        mb(arrow_bytes as u64) / put_time.as_secs_f64()
    );

    // Describe.
    let info = client.table("lineitem").await?;
    say!(
        "listed         table {}: {} columns, {} rows, {} partitions",
        info.name,
        info.schema.fields().len(),
        info.rows,
        info.description.partitions.len()
    );

    // Read everything back and compare with what was generated.
    let t0 = Instant::now();
    let before = client.stats().await?["requests"]["bytes_sent"]
        .as_u64()
        .unwrap_or(0);
    for (i, batches) in parts.iter().enumerate() {
        let got: Vec<RecordBatch> = client
            .scan("lineitem", Some(&format!("p{i}")), &[])
            .await?
            .try_collect()
            .await
            .map_err(Error::from)?;
        let want = concat_batches(&batches[0].schema(), batches)?;
        let got = concat_batches(&want.schema(), &got)?;
        if got != want {
            return Err(Error::Protocol(format!(
                "partition p{i} came back different from what was stored"
            )));
        }
    }
    let full_sent = client.stats().await?["requests"]["bytes_sent"]
        .as_u64()
        .unwrap_or(0)
        - before;
    say!(
        "read back      all {rows} rows, identical to the generated data, {:.1} MB over Flight in {:.2?}",
        mb(full_sent),
        t0.elapsed()
    );

    // A projected scan sends less.
    let t0 = Instant::now();
    let before = client.stats().await?["requests"]["bytes_sent"]
        .as_u64()
        .unwrap_or(0);
    let n: usize = client
        .scan("lineitem", None, &["l_shipdate", "l_extendedprice"])
        .await?
        .try_fold(0, |n, b| async move { Ok(n + b.num_rows()) })
        .await
        .map_err(Error::from)?;
    let proj_sent = client.stats().await?["requests"]["bytes_sent"]
        .as_u64()
        .unwrap_or(0)
        - before;
    say!(
        "projected      2 of 16 columns, {n} rows: {:.1} MB over Flight ({:.1}x less) in {:.2?}",
        mb(proj_sent),
        full_sent as f64 / proj_sent.max(1) as f64,
        t0.elapsed()
    );

    // Raw range read of a Parquet footer, as a compute tier without pushdown does.
    let obj = &info.description.partitions[0].objects[0];
    let tail = client.read_range(&obj.name, obj.len - 8, 8).await?;
    say!(
        "range read     last 8 bytes of {}: footer length {} + magic {:?}",
        obj.name,
        u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]),
        String::from_utf8_lossy(&tail[4..])
    );

    let s = client.stats().await?;
    say!(
        "node stats     device: {} reads / {:.1} MB read, {} writes / {:.1} MB written; store: {} objects, {:.1} MB, catalog generation {}",
        s["device"]["stats"]["reads"],
        mb(s["device"]["stats"]["bytes_read"].as_u64().unwrap_or(0)),
        s["device"]["stats"]["writes"],
        mb(s["device"]["stats"]["bytes_written"].as_u64().unwrap_or(0)),
        s["store"]["objects"],
        mb(s["store"]["bytes_stored"].as_u64().unwrap_or(0)),
        s["store"]["catalog_generation"]
    );
    drop(client);
    node.shutdown().await?;
    if opts.keep {
        let kept = dir.keep();
        say!("kept           device in {}", kept.display());
    }
    Ok(())
}
