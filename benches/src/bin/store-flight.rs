//! Object-store get throughput and Flight `DoGet` streaming throughput on loopback.
//!
//! 1. A large object on an io_uring device: `read_range` in 4 MiB pieces (checksums
//!    verified) vs raw device reads of the same blocks, concurrency 1 and 4.
//! 2. A storage node on loopback holding TPC-H lineitem: `DoGet` of raw object bytes
//!    (`Range` tickets) and of Arrow batches (`Scan` tickets), plain and with TLS and
//!    a tenant's token (the overhead of security, side by side).
//!
//! `cargo run --release -p csd-benches --bin store-flight -- [--object-mib 512] [--scale 0.5]`

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use csd_benches::{default_json_path, mbps, scratch_dir, write_json};
use csd_client::NodeClient;
use csd_client::demo::lineitem;
use csd_runtime::config::{ByteSize, NodeConfig};
use csd_runtime::device::uring::UringDevice;
use csd_runtime::device::{BlockDevice, DmaBuf};
use csd_runtime::node;
use csd_runtime::store::{ObjectStore, StoreOptions};
use futures::{StreamExt, TryStreamExt};
use serde::Serialize;

#[derive(Parser)]
struct Args {
    /// Object size in MiB for the store test.
    #[arg(long, default_value_t = 512)]
    object_mib: u64,
    /// TPC-H scale factor for the Flight test.
    #[arg(long, default_value_t = 0.5)]
    scale: f64,
    /// Directory for device files (disk-backed).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// JSON output path.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Serialize)]
struct Row {
    test: String,
    concurrency: usize,
    bytes: u64,
    seconds: f64,
    mb_per_s: f64,
    rows_per_s: Option<f64>,
}

const PIECE: u64 = 4 << 20;

/// Runs `read` over `items` with `conc` in flight and sums the bytes they return.
async fn sum_bytes<T, F, Fut>(items: Vec<T>, conc: usize, read: F) -> u64
where
    F: Fn(T) -> Fut,
    Fut: std::future::Future<Output = Result<u64, String>>,
{
    futures::stream::iter(items)
        .map(read)
        .buffer_unordered(conc)
        .try_fold(0u64, |a, n| async move { Ok(a + n) })
        .await
        .expect("read")
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let dir = scratch_dir(args.dir.clone()).expect("scratch dir");
    let mut rows: Vec<Row> = Vec::new();
    let mut row = |test: &str, concurrency: usize, bytes: u64, secs: f64, nrows: Option<u64>| {
        let r = Row {
            test: test.into(),
            concurrency,
            bytes,
            seconds: secs,
            mb_per_s: mbps(bytes, secs),
            rows_per_s: nrows.map(|n| n as f64 / secs),
        };
        println!(
            "{:<52} {:>4} {:>10.1} {:>10.0} {:>14}",
            r.test,
            concurrency,
            bytes as f64 / 1e6,
            r.mb_per_s,
            r.rows_per_s.map(|x| format!("{x:.0}")).unwrap_or_default()
        );
        rows.push(r);
    };
    println!(
        "{:<52} {:>4} {:>10} {:>10} {:>14}",
        "test", "conc", "MB", "MB/s", "rows/s"
    );

    // 1. Object store over io_uring.
    let size = args.object_mib << 20;
    let dev: Arc<dyn BlockDevice> = Arc::new(
        UringDevice::open(
            &dir.path().join("store.img"),
            Some(size + size / 4 + (64 << 20)),
            64,
        )
        .expect("device"),
    );
    let store = ObjectStore::open(dev.clone(), StoreOptions::default())
        .await
        .expect("store");
    let mut w = store.create("bench/object").expect("create");
    let chunk: Vec<u8> = (0..(1 << 20))
        .map(|i: u32| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let t0 = Instant::now();
    for _ in 0..args.object_mib {
        w.write(&chunk).await.expect("write");
    }
    let info = w.finish().await.expect("finish");
    row(
        "object put (io_uring, CRC32C per 64 KiB)",
        1,
        size,
        t0.elapsed().as_secs_f64(),
        None,
    );
    for conc in [1usize, 4] {
        let t0 = Instant::now();
        let pieces = size.div_ceil(PIECE);
        let total = sum_bytes((0..pieces).collect(), conc, |i| {
            let (store, info) = (store.clone(), info.clone());
            async move {
                let off = i * PIECE;
                store
                    .read_object_range(&info, off, PIECE.min(size - off))
                    .await
                    .map(|b| b.len() as u64)
                    .map_err(|e| e.to_string())
            }
        })
        .await;
        row(
            "object get, 4 MiB ranges (verified)",
            conc,
            total,
            t0.elapsed().as_secs_f64(),
            None,
        );
        // Raw device reads of the same extents, for the store's overhead.
        let t0 = Instant::now();
        let bs = dev.geometry().block_size as u64;
        let cmds: Vec<(u64, u64)> = info
            .extents
            .iter()
            .flat_map(|e| {
                (0..e.blocks)
                    .step_by((PIECE / bs) as usize)
                    .map(move |o| (e.lba + o, (PIECE / bs).min(e.blocks - o)))
            })
            .collect();
        let total = sum_bytes(cmds, conc, |(lba, n)| {
            let dev = dev.clone();
            async move {
                dev.read(lba, DmaBuf::recycled((n * bs) as usize))
                    .await
                    .map(|b| b.len() as u64)
                    .map_err(|e| e.to_string())
            }
        })
        .await;
        row(
            "  raw device reads of the same extents",
            conc,
            total,
            t0.elapsed().as_secs_f64(),
            None,
        );
    }
    drop(store);

    // 2. Flight on loopback, plain and with TLS + a tenant's token (same run).
    let security = dir.path().join("security");
    csd_runtime::tls::make_certificates(&["127.0.0.1".into()], "bench")
        .expect("certificates")
        .write(&security)
        .expect("write certificates");
    std::fs::write(
        security.join("tenants.toml"),
        format!(
            "[[tenant]]\nname = \"bench\"\ntoken_sha256 = \"{}\"\ntables = [\"*\"]\ncan = [\"read\", \"write\", \"admin\"]\n",
            csd_runtime::auth::token_digest("bench-token")
        ),
    )
    .expect("tenants file");
    for secure in [false, true] {
        let suffix = if secure { " [TLS + token]" } else { "" };
        let node = node::start(&NodeConfig {
            device: dir
                .path()
                .join(format!("node{}.img", u8::from(secure)))
                .display()
                .to_string(),
            capacity: ByteSize::gib(8),
            listen: "127.0.0.1:0".into(),
            cpus: 2,
            format: true,
            auth: secure.then(|| security.join("tenants.toml")),
            tls_cert: secure.then(|| security.join("node.pem")),
            tls_key: secure.then(|| security.join("node.key")),
            ..NodeConfig::default()
        })
        .await
        .expect("node");
        let creds = if secure {
            csd_runtime::node_client::Credentials::from_files(
                Some("bench-token".into()),
                Some(&security.join("ca.pem")),
                None,
                None,
            )
            .expect("credentials")
        } else {
            Default::default()
        };
        let client = NodeClient::connect_with(&node.url, &creds)
            .await
            .expect("connect");
        let parts = 4;
        let t0 = Instant::now();
        let mut arrow_bytes = 0u64;
        for p in 1..=parts {
            let batches = lineitem(args.scale, p, parts).expect("tpchgen");
            arrow_bytes += batches
                .iter()
                .map(|b| b.get_array_memory_size() as u64)
                .sum::<u64>();
            let schema = batches[0].schema();
            client
                .put(
                    "lineitem",
                    &format!("p{p}"),
                    schema,
                    futures::stream::iter(batches.into_iter().map(Ok)),
                )
                .await
                .expect("put");
        }
        row(
            &format!("DoPut lineitem (Arrow bytes in){suffix}"),
            1,
            arrow_bytes,
            t0.elapsed().as_secs_f64(),
            None,
        );
        let table = client.table("lineitem").await.expect("table");
        let objects: Vec<(String, u64)> = table
            .description
            .partitions
            .iter()
            .flat_map(|p| p.objects.iter().map(|o| (o.name.clone(), o.len)))
            .collect();
        for conc in [1usize, 4] {
            let t0 = Instant::now();
            let total = sum_bytes(objects.clone(), conc, |(name, len)| {
                let c = client.clone();
                async move {
                    c.read_range(&name, 0, len)
                        .await
                        .map(|b| b.len() as u64)
                        .map_err(|e| e.to_string())
                }
            })
            .await;
            row(
                &format!("DoGet Range: raw Parquet bytes{suffix}"),
                conc,
                total,
                t0.elapsed().as_secs_f64(),
                None,
            );
        }
        for conc in [1usize, 4] {
            let before = client.stats().await.expect("stats").requests.bytes_sent;
            let t0 = Instant::now();
            let nrows: u64 = futures::stream::iter(table.description.partitions.clone())
                .map(|p| {
                    let c = client.clone();
                    async move {
                        let s = c.scan("lineitem", Some(&p.name), &[]).await?;
                        s.try_fold(0u64, |a, b| async move { Ok(a + b.num_rows() as u64) })
                            .await
                            .map_err(csd_runtime::node_client::Error::from)
                    }
                })
                .buffer_unordered(conc)
                .try_fold(0u64, |a, n| async move { Ok(a + n) })
                .await
                .expect("scan");
            let secs = t0.elapsed().as_secs_f64();
            let sent = client.stats().await.expect("stats").requests.bytes_sent - before;
            row(
                &format!("DoGet Scan: Arrow batches{suffix}"),
                conc,
                sent,
                secs,
                Some(nrows),
            );
        }
        node.shutdown().await.expect("shutdown");
    }
    write_json(
        &args
            .json
            .unwrap_or_else(|| default_json_path("store-flight")),
        &rows,
    )
    .expect("write json");
}
