//! Nodes in QEMU guests on an emulated NVMe controller, driven through io_uring NVMe
//! passthrough (`--device nvme:/dev/ng0n1`): tables stored, read, deleted (Dataset
//! Management) and kept across a `kill -9` of the whole machine; a media error
//! injected under the namespace is data loss for the table above it alone. With an
//! SPDK build, the same through SPDK's user-space PCIe driver (`--device spdk:pcie=…`).
//!
//! Needs `scripts/setup-qemu.sh` (run by `scripts/test.sh`); without its kit the
//! tests say so and pass only when `CSD_REQUIRE_QEMU` is unset.

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow::array::{Int64Array, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use csd_runtime::node_client::NodeClient;
use csd_testbed::guest::{Guest, GuestSpec, Kit, MediaFault, default_binary};
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

/// A guest whose node (256 MiB budget) stores on a `disk_mib` namespace in `dir`.
async fn boot(dir: &std::path::Path, disk_mib: u64) -> Guest {
    let mut spec = GuestSpec::new(
        default_binary().unwrap(),
        dir.join("node.img"),
        dir.to_path_buf(),
    );
    spec.disk_bytes = disk_mib << 20;
    spec.node_args = vec!["--memory".into(), "256MiB".into()];
    Guest::boot(spec).await.unwrap()
}

/// The table a crash-test writer stores as `t{seed}`.
fn table(seed: i64) -> RecordBatch {
    batch(seed, 20_000 + (seed as usize * 977) % 20_000)
}

/// The node's `table` holds exactly `want`'s rows.
async fn assert_holds(c: &NodeClient, table: &str, want: &RecordBatch, what: &str) {
    assert_eq!(
        rows(&scan(c, table).await),
        rows(std::slice::from_ref(want)),
        "{what}: table {table}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_node_stores_through_nvme_passthrough_and_survives_kill_9() {
    if kit().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut g = boot(dir.path(), 256).await;
    eprintln!("guest booted in {:.1} s", g.boot_s);
    stores_deletes_and_survives_kill_9(&mut g, "nvme:/dev/ng0n1").await;
}

/// On guest `g`'s node (device `on…`, a 256 MiB namespace): tables stored and read,
/// one deleted (its blocks deallocated) and the space written again, then the whole
/// machine killed; every table acknowledged is there after, the deleted one is not.
async fn stores_deletes_and_survives_kill_9(g: &mut Guest, on: &str) {
    let c = NodeClient::connect(&g.url).await.unwrap();
    let stats = c.stats().await.unwrap();
    let geo = &stats.device.geometry;
    assert!(
        geo.name.starts_with(on),
        "the node runs on {:?}, not on {on}",
        geo.name
    );
    // 512-byte LBAs under 4 KiB store blocks: 256 MiB = 65536 blocks.
    assert_eq!((geo.block_size, geo.num_blocks), (4096, 65536), "{geo:?}");

    let kept = batch(1, 50_000);
    put(&c, "kept", &kept).await;
    let gone = batch(2, 50_000);
    put(&c, "gone", &gone).await;
    assert_holds(&c, "kept", &kept, "stored").await;
    assert_holds(&c, "gone", &gone, "stored").await;
    // Deleting sends Dataset Management; the space comes back and is written again.
    let gone_bytes: u64 = c.objects("gone").await.unwrap().iter().map(|o| o.len).sum();
    assert!(gone_bytes > 0);
    c.delete("gone", None).await.unwrap();
    let again = batch(3, 50_000);
    put(&c, "again", &again).await;
    assert_holds(&c, "again", &again, "stored").await;
    assert_holds(&c, "kept", &kept, "stored").await;
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
    assert_holds(&c, "kept", &kept, "after kill -9").await;
    assert_holds(&c, "again", &again, "after kill -9").await;
    let tables: Vec<String> = c
        .list_tables("")
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert!(!tables.contains(&"gone".to_string()), "{tables:?}");
}

/// What a writer was told, and what it was doing when the machine died.
#[derive(Default)]
struct Acks {
    /// Tables acknowledged stored, by seed.
    stored: BTreeMap<String, i64>,
    /// Tables acknowledged deleted.
    deleted: BTreeSet<String>,
    /// The call in flight when the node went away: may or may not have happened.
    in_flight: Option<(String, Option<i64>)>,
}

/// Stores tables (deleting every third one it stored) until a call fails.
async fn write_until_killed(c: NodeClient, first: i64, acks: Arc<Mutex<Acks>>) {
    for i in first.. {
        let name = format!("t{i}");
        acks.lock().unwrap().in_flight = Some((name.clone(), Some(i)));
        let b = table(i);
        let put = c
            .put(&name, "p0", b.schema(), futures::stream::iter(vec![Ok(b)]))
            .await;
        if put.is_err() {
            return;
        }
        {
            let mut a = acks.lock().unwrap();
            a.stored.insert(name, i);
            a.in_flight = None;
        }
        if i % 3 == 0 {
            let victim = format!("t{}", i - 1);
            if !acks.lock().unwrap().stored.contains_key(&victim) {
                continue;
            }
            acks.lock().unwrap().in_flight = Some((victim.clone(), None));
            if c.delete(&victim, None).await.is_err() {
                return;
            }
            let mut a = acks.lock().unwrap();
            a.stored.remove(&victim);
            a.deleted.insert(victim);
            a.in_flight = None;
        }
    }
}

/// `kill -9` of the whole machine while tables are being stored and deleted, a few
/// times (`CSD_GUEST_CRASH_RUNS`, default 3): after each reboot on the same backing
/// file every acknowledged table is there with its rows, every acknowledged delete
/// stays deleted, and the call cut off either happened whole or not at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_killed_mid_upload_keeps_every_acknowledged_table() {
    if kit().is_none() {
        return;
    }
    let rounds: u64 = std::env::var("CSD_GUEST_CRASH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let dir = tempfile::tempdir().unwrap();
    let mut g = boot(dir.path(), 512).await;
    let acks = Arc::new(Mutex::new(Acks::default()));
    let mut next = 0i64;
    for round in 0..rounds {
        let c = NodeClient::connect(&g.url).await.unwrap();
        let writer = tokio::spawn(write_until_killed(c, next, acks.clone()));
        // Different moments in different rounds: mid-put, mid-commit, mid-delete.
        tokio::time::sleep(Duration::from_millis(2_000 + 1_300 * round)).await;
        g.kill();
        writer.await.unwrap();
        g.restart()
            .await
            .unwrap_or_else(|e| panic!("round {round}: reboot after kill -9: {e}"));
        let c = NodeClient::connect(&g.url).await.unwrap();
        let present: BTreeSet<String> = c
            .list_tables("")
            .await
            .unwrap()
            .into_iter()
            .map(|t| t.name)
            .collect();
        let (in_flight, stored, deleted) = {
            let mut a = acks.lock().unwrap_or_else(|p| p.into_inner());
            let stored: Vec<(String, i64)> =
                a.stored.iter().map(|(k, v)| (k.clone(), *v)).collect();
            (a.in_flight.take(), stored, a.deleted.clone())
        };
        assert!(
            !stored.is_empty(),
            "round {round}: nothing was stored before the kill"
        );
        let what = format!("round {round}: acknowledged");
        for (name, seed) in &stored {
            assert_holds(&c, name, &table(*seed), &what).await;
        }
        for name in &deleted {
            assert!(
                !present.contains(name),
                "round {round}: {name} was deleted, acknowledged, and is back"
            );
        }
        // The cut-off call: all or nothing.
        if let Some((name, Some(seed))) = in_flight
            && present.contains(&name)
        {
            let what = format!("round {round}: the put cut off by the kill, if there, is whole");
            assert_holds(&c, &name, &table(seed), &what).await;
            acks.lock().unwrap().stored.insert(name, seed);
        }
        let known: BTreeSet<&String> = stored.iter().map(|(n, _)| n).collect();
        next = present
            .iter()
            .chain(known.iter().copied())
            .filter_map(|n| n.strip_prefix('t')?.parse::<i64>().ok())
            .max()
            .unwrap_or(next)
            + 1;
        eprintln!(
            "round {round}: {} tables acknowledged, {} deletes, reboot {:.1} s",
            stored.len(),
            deleted.len(),
            g.boot_s
        );
    }
}

/// The shipped `qemu` scenario: two guests, TPC-H SF 0.01, every query under no
/// pushdown, full pushdown and the node's own judgement, answers compared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tpch_on_two_guest_nodes_answers_as_without_pushdown() {
    if kit().is_none() {
        return;
    }
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/qemu.toml");
    let s = csd_testbed::scenario::Scenario::from_file(&path).unwrap();
    let out = tempfile::tempdir().unwrap();
    let t = std::time::Instant::now();
    let r = csd_testbed::run(
        s,
        &csd_testbed::RunOptions {
            out: out.path().to_path_buf(),
            quick: false,
            progress: false,
        },
    )
    .await
    .unwrap();
    eprintln!("qemu scenario: {:.1} s", t.elapsed().as_secs_f64());
    assert_eq!(r.runs.len(), 3);
    for run in &r.runs {
        assert!(
            run.mismatches.is_empty(),
            "{}: {:?}",
            run.policy,
            run.mismatches
        );
        assert_eq!(run.failed, 0, "{}: {:?}", run.policy, run.errors);
        assert_eq!(run.completed, 22, "{}", run.policy);
    }
    let by = |p: &str| {
        r.runs
            .iter()
            .find(|x| x.policy.to_string() == p)
            .unwrap_or_else(|| panic!("no {p} run"))
    };
    // Pushdown moved fewer bytes from the guests than pulling the tables.
    assert!(
        by("full").bytes_from_nodes * 2 < by("none").bytes_from_nodes,
        "full {} vs none {}",
        by("full").bytes_from_nodes,
        by("none").bytes_from_nodes
    );
    // One boot time per cluster started (the node policy differs for `full`).
    assert_eq!(r.boot_s.len(), r.load_s.len());
    let md = std::fs::read_to_string(out.path().join("report.md")).unwrap();
    assert!(
        md.contains("each in a QEMU guest") && md.contains("nvme:/dev/ng0n1"),
        "{md}"
    );
}

/// A media error under a stored table, injected below the guest: QEMU's `blkdebug`
/// fails the reads of one sector in the middle of the table's data, and the emulated
/// controller answers them with Unrecovered Read Error, as a failing drive does.
/// Reading that table fails with DATA_LOSS naming the NVMe status; the other table
/// reads as stored, and the node serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_media_error_under_a_table_is_data_loss_for_that_table_alone() {
    if kit().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut g = boot(dir.path(), 256).await;
    let c = NodeClient::connect(&g.url).await.unwrap();
    let victim = batch(5, 50_000);
    put(&c, "victim", &victim).await;
    let bystander = batch(6, 50_000);
    put(&c, "bystander", &bystander).await;
    let block = c.stats().await.unwrap().device.geometry.block_size as u64;
    let objects = c.objects("victim").await.unwrap();
    let e = objects
        .iter()
        .flat_map(|o| o.extents.iter())
        .max_by_key(|e| e.blocks)
        .copied()
        .expect("the victim's extents");
    let at = (e.lba + e.blocks / 2) * block;

    g.restart_with_faults(vec![MediaFault::read(at)])
        .await
        .unwrap();
    let c = NodeClient::connect(&g.url).await.unwrap();
    let read: Result<Vec<RecordBatch>, (Option<tonic::Code>, String)> = async {
        let s = c
            .scan("victim", None, &[])
            .await
            .map_err(|e| (e.code(), e.to_string()))?;
        s.try_collect().await.map_err(|e| {
            let e = csd_runtime::node_client::Error::from(e);
            (e.code(), e.to_string())
        })
    }
    .await;
    let (code, msg) = match read {
        Ok(b) => panic!(
            "the victim read whole ({} rows) over a failing sector at byte {at}",
            b.iter().map(|b| b.num_rows()).sum::<usize>()
        ),
        Err(e) => e,
    };
    assert_eq!(code, Some(tonic::Code::DataLoss), "{msg}");
    // The NVMe status, as the controller answered it, and where.
    assert!(msg.contains("unrecovered read error"), "{msg}");
    assert!(msg.contains("nvme:/dev/ng0n1"), "{msg}");
    assert_holds(&c, "bystander", &bystander, "beside a media error").await;
    let stats = c.stats().await.unwrap();
    assert!(stats.device.stats.reads > 0, "{:?}", stats.device.stats);
    // The drive reads the sector again: the node kept the table, nothing dropped.
    g.restart_with_faults(vec![]).await.unwrap();
    let c = NodeClient::connect(&g.url).await.unwrap();
    assert_holds(&c, "victim", &victim, "once the sector reads again").await;
    assert_holds(&c, "bystander", &bystander, "once the sector reads again").await;
}

/// SPDK's user-space NVMe driver on the guest's emulated controller (bound to
/// `uio_pci_generic`): tables stored, read, deleted (unmapped) and kept across a
/// `kill -9` of the whole machine. Needs `SPDK_DIR` (a build of
/// `scripts/build-spdk.sh`) and `CSD_GUEST_SPDK_BINARY` (a `csd` built with
/// `--features spdk` against it); says so and passes without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_node_stores_through_spdks_pcie_driver_and_survives_kill_9() {
    if kit().is_none() {
        return;
    }
    let (Some(spdk), Some(binary)) = (
        std::env::var_os("SPDK_DIR"),
        std::env::var_os("CSD_GUEST_SPDK_BINARY"),
    ) else {
        eprintln!(
            "skipping SPDK in a guest: set SPDK_DIR (scripts/build-spdk.sh) and \
             CSD_GUEST_SPDK_BINARY (cargo build -p csd-client --features spdk)"
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut spec = GuestSpec::new(
        binary.into(),
        dir.path().join("node.img"),
        dir.path().into(),
    )
    .with_spdk(spdk.into());
    spec.disk_bytes = 256 << 20;
    spec.cpus = 2;
    spec.node_args = vec!["--memory".into(), "256MiB".into()];
    let mut g = Guest::boot(spec).await.unwrap_or_else(|e| panic!("{e}"));
    eprintln!("SPDK guest booted in {:.1} s", g.boot_s);
    stores_deletes_and_survives_kill_9(&mut g, "spdk:pcie=").await;
}
