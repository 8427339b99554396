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
use arrow::datatypes::DataType;
use arrow::record_batch::RecordBatch;
use csd_runtime::node_client::NodeClient;
use csd_testbed::guest::{
    Arch, Guest, GuestSpec, Kit, MediaFault, default_binary, default_binary_for,
};
use futures::TryStreamExt;

mod common;
use common::kit;

use common::batch;

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

/// The aarch64 `csd` for arm64 guests, or `None` (saying what is missing) where the
/// arm64 kit or the cross build is not there and `CSD_REQUIRE_ARM64` is unset: both
/// are opt-in (`scripts/setup-qemu.sh --arch aarch64`, `scripts/build-aarch64.sh`).
fn arm64() -> Option<std::path::PathBuf> {
    match Kit::find_for(Arch::Aarch64).and_then(|_| default_binary_for(Arch::Aarch64)) {
        Ok(b) => Some(b),
        Err(e) if std::env::var_os("CSD_REQUIRE_ARM64").is_none() => {
            eprintln!(
                "skipping the arm64 guest tests (opt in: scripts/setup-qemu.sh --arch aarch64 \
                 && scripts/build-aarch64.sh): {e}"
            );
            None
        }
        Err(e) => panic!("CSD_REQUIRE_ARM64 is set: {e}"),
    }
}

fn mib(b: Option<u64>) -> String {
    b.map_or("?".into(), |b| format!("{:.0}", b as f64 / 1048576.0))
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
        // A delete cut off by the kill is in doubt: its table is whole or gone.
        let doubted_delete = match &in_flight {
            Some((name, None)) => Some(name.clone()),
            _ => None,
        };
        let what = format!("round {round}: acknowledged");
        for (name, seed) in &stored {
            if doubted_delete.as_ref() == Some(name) && !present.contains(name) {
                let mut a = acks.lock().unwrap();
                a.stored.remove(name);
                a.deleted.insert(name.clone());
                continue;
            }
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

/// Runs the shipped scenario `file` (22 TPC-H queries under none, full and adaptive)
/// and checks every run answered every query as without pushdown; returns the
/// results and the report's text.
async fn tpch_scenario(file: &str) -> (csd_testbed::report::Report, String) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scenarios")
        .join(file);
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
    eprintln!("{file}: {:.1} s", t.elapsed().as_secs_f64());
    assert_eq!(r.runs.len(), 3);
    for run in &r.runs {
        assert!(
            run.mismatches.is_empty(),
            "{file}, {}: {:?}",
            run.policy,
            run.mismatches
        );
        assert_eq!(run.failed, 0, "{file}, {}: {:?}", run.policy, run.errors);
        assert_eq!(run.completed, 22, "{file}, {}", run.policy);
    }
    let md = std::fs::read_to_string(out.path().join("report.md")).unwrap();
    (r, md)
}

/// The shipped `qemu` scenario: two guests, TPC-H SF 0.01, every query under no
/// pushdown, full pushdown and the node's own judgement, answers compared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tpch_on_two_guest_nodes_answers_as_without_pushdown() {
    if kit().is_none() {
        return;
    }
    let (r, md) = tpch_scenario("qemu.toml").await;
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

/// A CSD-shaped node: an arm64 guest (four Cortex-A53 cores, 2 GiB, `--cpus 4
/// --memory 2GiB`) running the aarch64 build on NVMe passthrough stores, reads,
/// deletes (Dataset Management) and keeps its tables across a `kill -9` of the whole
/// machine, as the x86-64 guest does. Prints what carries over from emulation: the
/// start-up time against an x86-64 guest of the same size booted here just before,
/// the node's resident memory idle and after work, and the binaries' sizes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_csd_shaped_arm64_node_stores_through_nvme_passthrough_and_survives_kill_9() {
    if kit().is_none() {
        return;
    }
    let Some(binary) = arm64() else { return };
    let dir = tempfile::tempdir().unwrap();
    // Start-up against an x86-64 guest of the same size, booted in turn (medians of 3).
    let mut boots: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..3 {
        for (i, (arch, bin)) in [
            (Arch::X86_64, default_binary().unwrap()),
            (Arch::Aarch64, binary.clone()),
        ]
        .into_iter()
        .enumerate()
        {
            let mut spec = GuestSpec::csd(
                bin,
                dir.path().join(format!("boot{i}.img")),
                dir.path().into(),
            );
            spec.arch = arch;
            spec.disk_bytes = 256 << 20;
            let g = Guest::boot(spec).await.unwrap_or_else(|e| panic!("{e}"));
            boots[i].push(g.boot_s);
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (x86_boot, arm_boot) = (median(&boots[0]), median(&boots[1]));
    let mut spec = GuestSpec::csd(
        binary.clone(),
        dir.path().join("node.img"),
        dir.path().into(),
    );
    spec.disk_bytes = 256 << 20;
    let mut g = Guest::boot(spec).await.unwrap_or_else(|e| panic!("{e}"));
    let c = NodeClient::connect(&g.url).await.unwrap();
    let idle = c.stats().await.unwrap();
    assert_eq!(idle.cpus, 4, "the node's cores");
    assert_eq!(idle.memory_budget, 2 << 30, "the node's budget");
    stores_deletes_and_survives_kill_9(&mut g, "nvme:/dev/ng0n1").await;
    // Work after the reboot: a 200,000-row table stored and scanned twice.
    let c = NodeClient::connect(&g.url).await.unwrap();
    let big = batch(9, 200_000);
    put(&c, "big", &big).await;
    assert_holds(&c, "big", &big, "on arm64").await;
    assert_holds(&c, "big", &big, "on arm64, again").await;
    let after = c.stats().await.unwrap();
    let size = |p: &std::path::Path| std::fs::metadata(p).map_or(0, |m| m.len()) / 1048576;
    eprintln!(
        "arm64 guest (4 x Cortex-A53, 2 GiB, TCG): node answering {arm_boot:.1} s after QEMU \
         started, x86-64 guest of the same size {x86_boot:.1} s ({:.2}x; medians of 3, x86-64 \
         then aarch64: {boots:.1?}); node resident \
         {} MiB idle, {} MiB peak after storing and scanning 200,000 rows; binaries: aarch64 {} MiB \
         ({}), x86-64 {} MiB",
        arm_boot / x86_boot,
        mib(idle.resident_bytes),
        mib(after.peak_resident_bytes),
        size(&binary),
        binary.display(),
        size(&default_binary().unwrap()),
    );
}

/// The shipped `qemu-arm64` scenario: TPC-H SF 0.01 on a CSD-shaped arm64 guest
/// node, every query under no pushdown, full pushdown and the node's own judgement,
/// answers compared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tpch_on_an_arm64_guest_node_answers_as_without_pushdown() {
    if kit().is_none() || arm64().is_none() {
        return;
    }
    let (_, md) = tpch_scenario("qemu-arm64.toml").await;
    assert!(
        md.contains("TCG, aarch64;") && md.contains("cloud-arm64"),
        "{md}"
    );
}

/// An example Wasm guest (`scripts/build-wasm-examples.sh`, run by `scripts/test.sh`),
/// or `None` saying it is not built.
fn wasm_example(name: &str) -> Option<Vec<u8>> {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let path = target.join("wasm").join(format!("{name}.wasm"));
    match std::fs::read(&path) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!(
                "skipping: {}: {e} (scripts/build-wasm-examples.sh builds it)",
                path.display()
            );
            None
        }
    }
}

/// Rows as sorted text, floats to 9 significant digits (a sum's order differs
/// between plans).
fn rows_text(batches: &[RecordBatch]) -> Vec<String> {
    let mut out = Vec::new();
    for b in batches {
        for i in 0..b.num_rows() {
            let cells: Vec<String> = b
                .columns()
                .iter()
                .map(|c| match c.data_type() {
                    DataType::Float64 => {
                        use arrow::array::AsArray;
                        let v = c.as_primitive::<arrow::datatypes::Float64Type>().value(i);
                        format!("{v:.8e}")
                    }
                    _ => arrow::util::display::array_value_to_string(c, i).unwrap(),
                })
                .collect();
            out.push(cells.join("|"));
        }
    }
    out.sort();
    out
}

/// A CSD-shaped arm64 guest holding TPC-H SF 0.01 `lineitem` in two partitions.
async fn csd_with_lineitem(binary: std::path::PathBuf, dir: &std::path::Path) -> Guest {
    let mut spec = GuestSpec::csd(binary, dir.join("node.img"), dir.into());
    spec.disk_bytes = 512 << 20;
    let g = Guest::boot(spec).await.unwrap_or_else(|e| panic!("{e}"));
    let c = NodeClient::connect(&g.url).await.unwrap();
    for i in 0..2 {
        let (schema, part) = csd_testbed::tpch::generate("lineitem", 0.01, i + 1, 2).unwrap();
        c.put(
            "lineitem",
            &format!("p{i}"),
            schema,
            futures::stream::iter(part.into_iter().map(Ok)),
        )
        .await
        .unwrap();
    }
    g
}

async fn session(url: &str, pushdown: bool) -> csd_query_pushdown::CsdSession {
    csd_query_pushdown::Cluster::connect(&[url.to_string()])
        .await
        .unwrap()
        .session(csd_query_pushdown::SessionOptions {
            pushdown,
            ..Default::default()
        })
        .await
        .unwrap()
}

/// Wasm on the drive's cores: the arm64 node compiles the example guests with
/// Cranelift's aarch64 backend; a shipped filter + map and Wasm SQL functions inside
/// a pushed-down fragment answer as the same computation in SQL without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wasm_on_an_arm64_guest_node_answers_as_sql() {
    if kit().is_none() {
        return;
    }
    let Some(binary) = arm64() else { return };
    let (Some(filter_map), Some(functions)) =
        (wasm_example("filter_map"), wasm_example("functions"))
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let g = csd_with_lineitem(binary, dir.path()).await;
    let (pushed, local) = (session(&g.url, true).await, session(&g.url, false).await);

    let job = csd_query_pushdown::WasmJob {
        module: filter_map.into(),
        table: "lineitem".into(),
        columns: ["l_orderkey", "l_extendedprice", "l_discount", "l_shipmode"]
            .map(String::from)
            .to_vec(),
        filter: Some("l_quantity < 30".into()),
        args: [("mode".to_string(), "AIR".to_string())].into(),
        rows: true,
    };
    let run = pushed.run_wasm(&job).await.unwrap();
    assert!(
        run.endpoints.iter().all(|e| e.pushed_back.is_none()),
        "the arm64 node handed the module back: {:?}",
        run.endpoints
    );
    let want = local
        .run(
            "SELECT l_orderkey, CAST(l_extendedprice AS DOUBLE) * (1 - CAST(l_discount AS DOUBLE)) \
             FROM lineitem WHERE l_quantity < 30 AND l_shipmode = 'AIR'",
        )
        .await
        .unwrap()
        .batches;
    let want = rows_text(&want);
    assert!(!want.is_empty());
    assert_eq!(rows_text(&run.batches), want, "filter_map on arm64");

    for s in [&pushed, &local] {
        for f in ["discounted", "word_count"] {
            s.register_wasm_udf(f, &functions, f).await.unwrap();
        }
    }
    let q = "SELECT l_returnflag, COUNT(*), SUM(discounted(l_extendedprice, l_discount)) \
             FROM lineitem WHERE word_count(l_comment) > 3 GROUP BY l_returnflag";
    let at_node = pushed.run(q).await.unwrap();
    assert!(
        at_node.node_runs.iter().all(|r| r.pushed_back.is_none()),
        "{:?}",
        at_node.node_runs
    );
    let got = rows_text(&at_node.batches);
    assert_eq!(got.len(), 3, "{got:?}");
    assert_eq!(
        got,
        rows_text(&local.run(q).await.unwrap().batches),
        "Wasm SQL functions on arm64"
    );
}

/// The drive's four weak cores under more work than they can take: twelve compute
/// clients send the same aggregate at once to a CSD-shaped arm64 node, first while
/// it has learned nothing of this work's cost on its cores, then again once it has.
/// Each time the node admits what fits and hands the rest back, which the clients
/// run themselves: every answer equals the query without pushdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_arm64_node_under_load_hands_work_back_and_every_answer_is_right() {
    if kit().is_none() {
        return;
    }
    let Some(binary) = arm64() else { return };
    let dir = tempfile::tempdir().unwrap();
    let g = csd_with_lineitem(binary, dir.path()).await;
    let q = "SELECT l_returnflag, l_linestatus, SUM(l_quantity), SUM(l_extendedprice), \
             AVG(l_discount), COUNT(*) FROM lineitem WHERE l_shipdate <= DATE '1998-09-02' \
             GROUP BY l_returnflag, l_linestatus";
    let want = rows_text(&session(&g.url, false).await.run(q).await.unwrap().batches);
    assert_eq!(want.len(), 4, "{want:?}");
    let mut clients = Vec::new();
    for _ in 0..12 {
        clients.push(session(&g.url, true).await);
    }
    for burst in ["cold", "learned"] {
        let runs = futures::future::join_all(clients.iter().map(|s| async {
            s.run(q)
                .await
                .unwrap_or_else(|e| panic!("a pushed query under load: {e}\n{}", g.log_tail(20)))
        }))
        .await;
        let (mut at_node, mut handed_back) = (0, 0);
        for run in &runs {
            assert_eq!(
                rows_text(&run.batches),
                want,
                "a pushed answer under load ({burst})"
            );
            for r in &run.node_runs {
                if r.work_pushed_back() {
                    handed_back += 1;
                } else {
                    at_node += 1;
                }
            }
        }
        let stats = NodeClient::connect(&g.url)
            .await
            .unwrap()
            .stats()
            .await
            .unwrap();
        eprintln!(
            "arm64 node, 12 clients at once ({burst}): {at_node} fragments run at the node, \
             {handed_back} handed back; node counters {:?}",
            stats.admission.counters
        );
        assert!(
            handed_back > 0,
            "{burst}: the node took all of it: {:?}",
            stats.admission
        );
        assert!(
            at_node > 0,
            "{burst}: the node took none of it: {:?}",
            stats.admission
        );
    }
}

/// The test ONNX models (scripts/onnx_test_models.py) written into `dir`, or `None`
/// (said) where scripts/setup-ml.sh has not run: the host's onnxruntime is the
/// reference.
fn onnx_models(dir: &std::path::Path) -> Option<std::path::PathBuf> {
    let py = csd_ml_pushdown::assets_dir().join("venv/bin/python");
    if !py.is_file() || !csd_ml_pushdown::onnx::runtime::available() {
        eprintln!("skipping: onnxruntime or the ML Python is missing (run scripts/setup-ml.sh)");
        return None;
    }
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/onnx_test_models.py");
    let out = std::process::Command::new(py)
        .arg(script)
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(dir.to_path_buf())
}

/// `n` PNGs of `side`² in two class folders, each image different.
fn images(dir: &std::path::Path, side: u32, n: u32) {
    for i in 0..n {
        let class = dir.join(format!("c{}", i % 2));
        std::fs::create_dir_all(&class).unwrap();
        image::RgbImage::from_fn(side, side, |x, y| {
            let noise = (x.wrapping_mul(7919) ^ y.wrapping_mul(104_729) ^ (i * 31)) % 61;
            image::Rgb([
                ((x * 255 / side + i * 40) % 256) as u8,
                (((x + y) * (i + 1) * 3 + noise) % 256) as u8,
                (noise * 3) as u8,
            ])
        })
        .save(class.join(format!("{i}.png")))
        .unwrap();
    }
}

/// Features by sample id of dataset `imgs` at `split` of `model` (`weights` its
/// bytes), with the split run, the partitions the node handed back and the
/// features: the node is asked to queue rather than hand work back.
async fn features_by_id(
    c: &NodeClient,
    model: csd_ml_pushdown::Arch,
    weights: Vec<u8>,
    split: csd_ml_pushdown::job::SplitChoice,
    pixels: Option<csd_ml_pushdown::model::PixelNorm>,
) -> (usize, u64, BTreeMap<u64, Vec<f32>>) {
    let opts = csd_ml_pushdown::job::FeaturesOptions {
        dataset: "imgs".into(),
        arch: model,
        split,
        train_batch: 3,
        dtype: csd_ml_pushdown::request::FeatureType::F32,
        compression: csd_runtime::protocol::Compression::Lz4Frame,
        pool: None,
        skip_bad_samples: false,
        keep: None,
        pixels,
        here: Some(0),
    };
    let (stream, r) =
        csd_ml_pushdown::job::features(std::slice::from_ref(c), &weights, &opts, false)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    let batches: Vec<_> = stream.try_collect().await.unwrap_or_else(|e| panic!("{e}"));
    let mut out = BTreeMap::new();
    for b in batches {
        for (id, row) in b.ids.into_iter().zip(b.features.to_vec2::<f32>().unwrap()) {
            assert!(out.insert(id, row).is_none(), "sample {id} twice");
        }
    }
    let pushed_back = r
        .stats
        .pushed_back
        .load(std::sync::atomic::Ordering::Relaxed);
    (r.split, pushed_back, out)
}

/// Every sample of `got` within 1e-4 of `want`, relative to the sample's largest
/// value.
fn assert_close(what: &str, got: &BTreeMap<u64, Vec<f32>>, want: &BTreeMap<u64, Vec<f32>>) {
    assert_eq!(got.len(), want.len(), "{what}: every sample");
    for (id, w) in want {
        let g = &got[id];
        assert_eq!(g.len(), w.len(), "{what}: sample {id}");
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
        let err = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            err <= 1e-4 * scale,
            "{what}: sample {id} off by {err} (scale {scale}) on aarch64"
        );
    }
}

/// An ONNX model's first layers on the drive's cores: an arm64 node runs the head of
/// two test models (a residual network and an NHWC chain) on onnxruntime's aarch64
/// build (`scripts/setup-qemu.sh --arch aarch64` unpacks it from PyPI's wheel), at
/// every cut point; the features equal the whole model run here, on x86-64's
/// onnxruntime, within float tolerance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn onnx_heads_on_an_arm64_guest_node_give_the_features_of_x86() {
    use csd_ml_pushdown::job::{SplitChoice, put_images};
    use csd_ml_pushdown::model::{OnnxModelStages, PixelNorm};
    use csd_ml_pushdown::{Arch as Model, StagedModel};
    if kit().is_none() {
        return;
    }
    let Some(binary) = arm64() else { return };
    let dir = tempfile::tempdir().unwrap();
    let Some(models) = onnx_models(dir.path()) else {
        return;
    };
    let Some(ort) = Kit::find_for(Arch::Aarch64).unwrap().onnxruntime else {
        let why = "no aarch64 onnxruntime in the arm64 kit (scripts/setup-qemu.sh --arch \
                   aarch64 unpacks it once scripts/setup-ml.sh has run)";
        assert!(std::env::var_os("CSD_REQUIRE_ARM64").is_none(), "{why}");
        eprintln!("skipping: {why}");
        return;
    };
    let imgs = dir.path().join("imgs");
    images(&imgs, 32, 8);
    let mut spec = GuestSpec::csd(binary, dir.path().join("node.img"), dir.path().into())
        .with_onnxruntime(ort);
    spec.disk_bytes = 256 << 20;
    let g = Guest::boot(spec).await.unwrap_or_else(|e| panic!("{e}"));
    let c = NodeClient::connect(&g.url).await.unwrap();
    put_images(
        std::slice::from_ref(&c),
        "imgs",
        &imgs,
        None,
        (2, 1),
        1,
        |_| {},
    )
    .await
    .unwrap();
    let norm = PixelNorm {
        mean: [0.485, 0.456, 0.406],
        std: [0.229, 0.224, 0.225],
    };
    let run = |bytes: Vec<u8>, split| features_by_id(&c, Model::Onnx, bytes, split, Some(norm));
    for name in ["residual", "chain_nhwc"] {
        let bytes = std::fs::read(models.join(format!("{name}.onnx"))).unwrap();
        let cuts = OnnxModelStages::load(&bytes, norm).unwrap().stages().len();
        assert!(cuts >= 2, "{name}: {cuts} cut points");
        let (_, _, want) = run(bytes.clone(), SplitChoice::None).await;
        assert_eq!(want.len(), 8, "{name}: every sample");
        let started = std::time::Instant::now();
        for k in 1..=cuts {
            let (split, pushed_back, got) = run(bytes.clone(), SplitChoice::Fixed(k)).await;
            assert_eq!(
                (split, pushed_back),
                (k, 0),
                "{name}: the node ran the head"
            );
            assert_eq!(got.len(), want.len(), "{name} split {k}: every sample");
            assert_close(&format!("{name} split {k}"), &got, &want);
        }
        eprintln!(
            "{name}: {cuts} cut points run at the arm64 node in {:.1} s, every feature within \
             1e-4 of x86-64's",
            started.elapsed().as_secs_f64()
        );
    }
}

/// The code that has an x86-64 vector path and a portable one elsewhere, run on the
/// drive's cores against the same work on this machine: the join-key filter's probe
/// (AVX2 here, scalar on aarch64) on a pushed join, whose answer equals the query
/// without pushdown; and the convolution kernels of the built-in models (AVX2/AVX-512
/// with FMA here, NEON's fused multiply-add on aarch64): EfficientNet-Lite0's first
/// stages, several blocks and the whole model at the arm64 node give the features
/// the whole model gives here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_portable_kernels_on_an_arm64_node_answer_as_x86s_vector_ones() {
    use csd_ml_pushdown::Arch as Model;
    use csd_ml_pushdown::job::{SplitChoice, put_images};
    if kit().is_none() {
        return;
    }
    let Some(binary) = arm64() else { return };
    let dir = tempfile::tempdir().unwrap();
    let g = csd_with_lineitem(binary, dir.path()).await;
    let (pushed, local) = (session(&g.url, true).await, session(&g.url, false).await);
    // A few hundred orders' keys out of 15,000: the probe side gets a filter of them.
    let q = "SELECT l.l_shipmode, COUNT(*), SUM(l.l_quantity) FROM lineitem l JOIN \
             (SELECT l_orderkey AS k FROM lineitem WHERE l_shipmode = 'MAIL' AND \
             l_quantity > 48) s ON l.l_orderkey = s.k GROUP BY l.l_shipmode";
    let run = pushed.run(q).await.unwrap();
    let text = run.plan_with_metrics();
    assert!(text.contains("key_filter=[l_orderkey]"), "{text}");
    let filtered: Vec<_> = run
        .node_runs
        .iter()
        .filter(|r| !r.direct && r.report.rows_scanned > 0)
        .collect();
    assert!(
        filtered.iter().all(|r| r.pushed_back.is_none()),
        "the arm64 node handed back: {text}"
    );
    let want = rows_text(&local.run(q).await.unwrap().batches);
    assert_eq!(want.len(), 7, "{want:?}");
    assert_eq!(
        rows_text(&run.batches),
        want,
        "a key-filtered join on arm64"
    );
    eprintln!(
        "key-filtered join at the arm64 node: {} fragments, rows scanned/returned {:?}",
        filtered.len(),
        filtered
            .iter()
            .map(|r| (r.report.rows_scanned, r.report.rows_returned))
            .collect::<Vec<_>>()
    );

    let weights = csd_ml_pushdown::assets_dir().join("efficientnet-lite0.safetensors");
    let Ok(bytes) = std::fs::read(&weights) else {
        eprintln!(
            "skipping the model kernels: no {} (run scripts/setup-ml.sh)",
            weights.display()
        );
        return;
    };
    let c = NodeClient::connect(&g.url).await.unwrap();
    let imgs = dir.path().join("imgs");
    images(&imgs, 64, 6);
    put_images(
        std::slice::from_ref(&c),
        "imgs",
        &imgs,
        None,
        (2, 1),
        1,
        |_| {},
    )
    .await
    .unwrap();
    let model = Model::EfficientNetLite0;
    let stages = model
        .load(&bytes, &candle_core::Device::Cpu)
        .unwrap()
        .stages()
        .len();
    let run = |split| features_by_id(&c, model, bytes.clone(), split, None);
    let (_, _, want) = run(SplitChoice::None).await;
    assert_eq!(want.len(), 6, "every sample");
    for k in [1, 4, stages] {
        let started = std::time::Instant::now();
        let (split, pushed_back, got) = run(SplitChoice::Fixed(k)).await;
        assert_eq!((split, pushed_back), (k, 0), "the node ran stages 0..{k}");
        assert_close(&format!("EfficientNet-Lite0 split {k}"), &got, &want);
        eprintln!(
            "EfficientNet-Lite0 stages 0..{k} of {stages} at the arm64 node: {:.1} s, features \
             within 1e-4 of x86-64's",
            started.elapsed().as_secs_f64()
        );
    }
}
