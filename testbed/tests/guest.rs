//! Nodes in QEMU guests on an emulated NVMe controller, driven through io_uring NVMe
//! passthrough (`--device nvme:/dev/ng0n1`): tables stored, read, deleted (Dataset
//! Management) and kept across a `kill -9` of the whole machine.
//!
//! Needs `scripts/setup-qemu.sh` (run by `scripts/test.sh`); without its kit the
//! tests say so and pass only when `CSD_REQUIRE_QEMU` is unset.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use arrow::array::{Int64Array, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use csd_runtime::node_client::NodeClient;
use csd_testbed::guest::{Guest, GuestSpec, Kit, default_binary};
use futures::TryStreamExt;

/// The kit, or `None` (with a message) where it is not installed.
fn kit() -> Option<Kit> {
    match Kit::find() {
        Ok(k) => Some(k),
        Err(e) if std::env::var_os("CSD_REQUIRE_QEMU").is_none() => {
            eprintln!("skipping the QEMU guest tests: {e}");
            None
        }
        Err(e) => panic!("CSD_REQUIRE_QEMU is set: {e}"),
    }
}

fn batch(seed: i64, rows: usize) -> RecordBatch {
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("text", DataType::Utf8, false),
    ]));
    let ids: Vec<i64> = (0..rows as i64).map(|i| i * 7 + seed).collect();
    let text: Vec<String> = ids.iter().map(|i| format!("row {i} of {seed}")).collect();
    RecordBatch::try_new(
        schema,
        vec![
            Arc::new(Int64Array::from(ids)),
            Arc::new(StringArray::from(text)),
        ],
    )
    .unwrap()
}

async fn put(c: &NodeClient, table: &str, b: &RecordBatch) {
    c.put(
        table,
        "p0",
        b.schema(),
        futures::stream::iter(vec![Ok(b.clone())]),
    )
    .await
    .unwrap_or_else(|e| panic!("put {table}: {e}"));
}

async fn scan(c: &NodeClient, table: &str) -> Vec<RecordBatch> {
    c.scan(table, None, &[])
        .await
        .unwrap_or_else(|e| panic!("scan {table}: {e}"))
        .try_collect()
        .await
        .unwrap_or_else(|e| panic!("scan {table}: {e}"))
}

fn rows(batches: &[RecordBatch]) -> Vec<(i64, String)> {
    let mut out = Vec::new();
    for b in batches {
        let ids = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
        let text = b.column(1).as_any().downcast_ref::<StringArray>().unwrap();
        for i in 0..b.num_rows() {
            out.push((ids.value(i), text.value(i).to_string()));
        }
    }
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_node_stores_through_nvme_passthrough_and_survives_kill_9() {
    if kit().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut spec = GuestSpec::new(
        default_binary().unwrap(),
        dir.path().join("node0.img"),
        dir.path().to_path_buf(),
    );
    spec.disk_bytes = 256 << 20;
    spec.node_args = vec!["--memory".into(), "256MiB".into()];
    let mut g = Guest::boot(spec).await.unwrap();
    eprintln!("guest booted in {:.1} s", g.boot_s);
    let c = NodeClient::connect(&g.url).await.unwrap();
    let stats = c.stats().await.unwrap();
    let geo = &stats.device.geometry;
    assert!(
        geo.name.starts_with("nvme:/dev/ng0n1"),
        "the node runs on {:?}, not on NVMe passthrough",
        geo.name
    );
    // 512-byte LBAs under 4 KiB store blocks: 256 MiB = 65536 blocks.
    assert_eq!((geo.block_size, geo.num_blocks), (4096, 65536), "{geo:?}");

    let kept = batch(1, 50_000);
    put(&c, "kept", &kept).await;
    let gone = batch(2, 50_000);
    put(&c, "gone", &gone).await;
    assert_eq!(rows(&scan(&c, "kept").await), rows(std::slice::from_ref(&kept)));
    assert_eq!(rows(&scan(&c, "gone").await), rows(std::slice::from_ref(&gone)));
    // Deleting sends Dataset Management; the space comes back and is written again.
    let gone_bytes: u64 = c.objects("gone").await.unwrap().iter().map(|o| o.len).sum();
    assert!(gone_bytes > 0);
    c.delete("gone", None).await.unwrap();
    let again = batch(3, 50_000);
    put(&c, "again", &again).await;
    assert_eq!(rows(&scan(&c, "again").await), rows(std::slice::from_ref(&again)));
    assert_eq!(rows(&scan(&c, "kept").await), rows(std::slice::from_ref(&kept)));
    let before = c.stats().await.unwrap().device.stats;
    assert!(
        before.writes > 0 && before.flushes > 0 && before.reads > 0,
        "{before:?}"
    );
    // At least the deleted table's bytes were deallocated.
    assert!(
        before.bytes_deallocated >= gone_bytes,
        "{before:?}: {gone_bytes} bytes deleted"
    );

    // The whole machine dies; the backing file is all that is left.
    g.restart().await.unwrap();
    let c = NodeClient::connect(&g.url).await.unwrap();
    assert_eq!(rows(&scan(&c, "kept").await), rows(&[kept]));
    assert_eq!(rows(&scan(&c, "again").await), rows(&[again]));
    let tables: Vec<String> = c
        .list_tables("")
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert!(!tables.contains(&"gone".to_string()), "{tables:?}");
}
