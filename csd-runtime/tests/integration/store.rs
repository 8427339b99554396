use std::collections::BTreeMap;
use std::sync::Arc;

use csd_runtime::Error;
use csd_runtime::device::emulated::{EmulatedDevice, TimingModel};
use csd_runtime::device::{BlockDevice, DmaBuf};
use csd_runtime::store::{ObjectStore, StoreOptions};
use proptest::prelude::*;

fn mem_device(bytes: u64) -> Arc<dyn BlockDevice> {
    Arc::new(EmulatedDevice::open(None, bytes, 4096, TimingModel::untimed()).unwrap())
}

async fn open(dev: &Arc<dyn BlockDevice>) -> ObjectStore {
    ObjectStore::open(dev.clone(), StoreOptions::default())
        .await
        .unwrap()
}

/// Checks that committed objects plus free space account for the whole data region.
pub async fn assert_consistent(store: &ObjectStore) {
    let s = store.stats().await;
    let used: u64 = store
        .list("")
        .iter()
        .flat_map(|o| o.extents.iter().map(|e| e.blocks))
        .sum();
    assert_eq!(
        used + s.free_blocks,
        s.data_blocks,
        "blocks leaked or double-counted: {s:?}"
    );
}

#[tokio::test]
async fn put_get_ranges_and_replace() {
    let dev = mem_device(16 << 20);
    let store = open(&dev).await;
    let data = crate::contents(1, 300_001);
    store.put("t/p0/a", &data).await.unwrap();
    assert_eq!(&store.get_all("t/p0/a").await.unwrap()[..], &data[..]);
    for (off, len) in [
        (0, 1),
        (65535, 2),
        (100_000, 150_000),
        (299_999, 2),
        (300_001, 0),
    ] {
        let got = store.read_range("t/p0/a", off, len).await.unwrap();
        assert_eq!(
            &got[..],
            &data[off as usize..(off + len) as usize],
            "range {off}+{len}"
        );
    }
    let e = store.read_range("t/p0/a", 300_000, 2).await.unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("beyond the end"),
        "{e}"
    );
    assert!(matches!(
        store.read_range("t/p0/zz", 0, 1).await,
        Err(Error::NotFound(_))
    ));
    // Empty objects are fine.
    store.put("t/p0/empty", b"").await.unwrap();
    assert_eq!(store.get_all("t/p0/empty").await.unwrap().len(), 0);
    // Replace keeps the name, changes contents; old space comes back.
    let small = crate::contents(2, 10);
    store.put("t/p0/a", &small).await.unwrap();
    assert_eq!(&store.get_all("t/p0/a").await.unwrap()[..], &small[..]);
    store.put("t/p1/b", &data).await.unwrap();
    assert_eq!(store.list("t/p0/").len(), 2);
    assert_eq!(store.delete_prefix("t/p0/").await.unwrap().len(), 2);
    assert_eq!(store.list("t/").len(), 1);
    assert_consistent(&store).await;
    drop(store);
    let store = open(&dev).await;
    assert_eq!(&store.get_all("t/p1/b").await.unwrap()[..], &data[..]);
    assert_consistent(&store).await;
    assert!(matches!(
        store.put("../etc", b"x").await,
        Err(Error::InvalidArgument(_))
    ));
}

#[tokio::test]
async fn device_full_harms_nothing_stored() {
    let dev = mem_device(4 << 20);
    let store = open(&dev).await;
    let mut stored = Vec::new();
    let mut i = 0;
    let err = loop {
        let d = crate::contents(i, 700_000);
        match store.put(&format!("o/{i}"), &d).await {
            Ok(_) => stored.push((i, d)),
            Err(e) => break e,
        }
        i += 1;
    };
    assert!(
        matches!(err, Error::ResourcesExhausted(_)) && err.to_string().contains("device full"),
        "{err}"
    );
    assert!(stored.len() >= 3);
    for (i, d) in &stored {
        assert_eq!(&store.get_all(&format!("o/{i}")).await.unwrap()[..], &d[..]);
    }
    // The failed put's blocks come back: after one delete a put fits again.
    store.delete("o/0").await.unwrap();
    store
        .put("o/again", &crate::contents(99, 700_000))
        .await
        .unwrap();
    assert_consistent(&store).await;
    drop(store);
    let store = open(&dev).await;
    assert_consistent(&store).await;
    assert_eq!(store.list("o/").len(), stored.len());
}

#[tokio::test]
async fn bit_flips_are_detected_never_returned() {
    let dev = mem_device(16 << 20);
    let store = open(&dev).await;
    let data = crate::contents(7, 200_000);
    let info = store.put("t/p/x", &data).await.unwrap();
    drop(store);
    // Flip one bit in the second data block (bytes 4096..8192).
    let lba = info.extents[0].lba + 1;
    let mut b = dev.read(lba, DmaBuf::zeroed(4096)).await.unwrap();
    b[17] ^= 0x04;
    dev.write(lba, b).await.unwrap();
    let store = open(&dev).await;
    let e = store.read_range("t/p/x", 5000, 10).await.unwrap_err();
    assert!(matches!(e, Error::Corrupt(_)), "{e}");
    assert!(
        e.to_string().contains("t/p/x") && e.to_string().contains("[0, 65536)"),
        "{e}"
    );
    assert_eq!(e.to_status().code(), tonic::Code::DataLoss);
    // Chunks without the flip still read.
    assert_eq!(
        &store.read_range("t/p/x", 70_000, 100).await.unwrap()[..],
        &data[70_000..70_100]
    );
    // Damage to the checksum table itself is also caught.
    let table_lba = info.extents.last().unwrap().end() - 1;
    let mut b = dev.read(table_lba, DmaBuf::zeroed(4096)).await.unwrap();
    b[0] ^= 1;
    dev.write(table_lba, b).await.unwrap();
    let store = open(&dev).await;
    let e = store.read_range("t/p/x", 70_000, 100).await.unwrap_err();
    assert!(e.to_string().contains("checksum table"), "{e}");
}

/// First block of catalog slot `slot` on a 16 MiB device (4096 blocks: 64-block slots).
fn slot_lba(slot: u64) -> u64 {
    let slot_blocks = (4096u64 / 256).clamp(64, 16384);
    1 + slot * slot_blocks
}

async fn flip(dev: &Arc<dyn BlockDevice>, lba: u64, at: &[usize]) {
    let mut b = dev.read(lba, DmaBuf::zeroed(4096)).await.unwrap();
    for &i in at {
        b[i] ^= 0x5A;
    }
    dev.write(lba, b).await.unwrap();
}

#[tokio::test]
async fn a_corrupt_catalog_slot_loses_nothing_acknowledged() {
    for slot in [0, 1] {
        let dev = mem_device(16 << 20);
        let store = open(&dev).await;
        store.put("a", b"first").await.unwrap();
        store.put("b", b"second").await.unwrap();
        drop(store);
        // Three flipped bytes in one slot's catalog (header and body).
        flip(&dev, slot_lba(slot), &[10, 40, 41]).await;
        let store = open(&dev).await;
        assert_eq!(&store.get_all("a").await.unwrap()[..], b"first");
        assert_eq!(
            &store.get_all("b").await.unwrap()[..],
            b"second",
            "slot {slot} corrupt: the acknowledged put must survive"
        );
        assert_consistent(&store).await;
        drop(store);
        // Opening repaired the slot: now the other one may fail too.
        flip(&dev, slot_lba(1 - slot), &[12, 50]).await;
        let store = open(&dev).await;
        assert_eq!(&store.get_all("b").await.unwrap()[..], b"second");
        store.put("c", b"third").await.unwrap();
        drop(store);
        let store = open(&dev).await;
        assert_eq!(&store.get_all("c").await.unwrap()[..], b"third");
    }
}

#[tokio::test]
async fn a_torn_commit_is_invisible() {
    let dev = mem_device(16 << 20);
    let store = open(&dev).await;
    store.put("a", b"first").await.unwrap();
    let generation = store.stats().await.catalog_generation;
    drop(store);
    // A crash while the next commit was written: one slot holds the header of a newer
    // generation over a body that does not match it.
    let mut b = dev.read(slot_lba(0), DmaBuf::zeroed(4096)).await.unwrap();
    b[8..16].copy_from_slice(&(generation + 1).to_le_bytes());
    dev.write(slot_lba(0), b).await.unwrap();
    let store = open(&dev).await;
    assert_eq!(&store.get_all("a").await.unwrap()[..], b"first");
    assert_eq!(store.stats().await.catalog_generation, generation);
    assert_consistent(&store).await;
    store.put("b", b"second").await.unwrap();
    drop(store);
    let store = open(&dev).await;
    assert_eq!(&store.get_all("b").await.unwrap()[..], b"second");
}

#[tokio::test]
async fn both_slots_corrupt_is_refused_loudly() {
    let dev = mem_device(16 << 20);
    let store = open(&dev).await;
    store.put("a", b"first").await.unwrap();
    drop(store);
    flip(&dev, slot_lba(0), &[40]).await;
    flip(&dev, slot_lba(1), &[40]).await;
    let Err(e) = ObjectStore::open(dev.clone(), StoreOptions::default()).await else {
        panic!("a store with no valid catalog slot opened");
    };
    assert!(e.to_string().contains("neither catalog slot"), "{e}");
    assert_eq!(e.to_status().code(), tonic::Code::DataLoss);
}

#[tokio::test]
async fn refuses_foreign_data() {
    let dev = mem_device(4 << 20);
    let mut b = DmaBuf::zeroed(4096);
    b[..5].copy_from_slice(b"ext4!");
    dev.write(0, b).await.unwrap();
    let e = ObjectStore::open(dev.clone(), StoreOptions::default())
        .await
        .err()
        .unwrap();
    assert!(e.to_string().contains("--format"), "{e}");
    let forced = StoreOptions {
        format: csd_runtime::store::FormatMode::Force,
        ..Default::default()
    };
    assert!(ObjectStore::open(dev, forced).await.is_ok());
}

#[derive(Debug, Clone)]
enum Op {
    Put(u8, usize),
    Delete(u8),
    Get(u8),
    Range(u8, u32, u32),
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..8, 0usize..400_000).prop_map(|(k, n)| Op::Put(k, n)),
        2 => (0u8..8).prop_map(Op::Delete),
        2 => (0u8..8).prop_map(Op::Get),
        2 => (0u8..8, any::<u32>(), 0u32..100_000).prop_map(|(k, o, l)| Op::Range(k, o, l)),
        1 => Just(Op::Reopen),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn store_matches_model(ops in proptest::collection::vec(op(), 1..40)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            // Small device: 2 MiB of data forces device-full paths.
            let dev = mem_device(3 << 20);
            let mut store = open(&dev).await;
            let mut model: BTreeMap<String, Vec<u8>> = BTreeMap::new();
            for (step, op) in ops.into_iter().enumerate() {
                match op {
                    Op::Put(k, n) => {
                        let name = format!("k/{k}");
                        let d = crate::contents(step as u64, n);
                        match store.put(&name, &d).await {
                            Ok(_) => { model.insert(name, d); }
                            Err(Error::ResourcesExhausted(_)) => {}
                            Err(e) => panic!("put: {e}"),
                        }
                    }
                    Op::Delete(k) => {
                        let name = format!("k/{k}");
                        let r = store.delete(&name).await;
                        assert_eq!(r.is_ok(), model.remove(&name).is_some());
                    }
                    Op::Get(k) => {
                        let name = format!("k/{k}");
                        match (store.get_all(&name).await, model.get(&name)) {
                            (Ok(b), Some(d)) => assert_eq!(&b[..], &d[..]),
                            (Err(Error::NotFound(_)), None) => {}
                            (r, m) => panic!("get {name}: {:?} vs model {:?}", r.map(|b| b.len()), m.map(|d| d.len())),
                        }
                    }
                    Op::Range(k, o, l) => {
                        let name = format!("k/{k}");
                        if let Some(d) = model.get(&name) {
                            let o = if d.is_empty() { 0 } else { o as usize % d.len() };
                            let l = (l as usize).min(d.len() - o);
                            let b = store.read_range(&name, o as u64, l as u64).await.unwrap();
                            assert_eq!(&b[..], &d[o..o + l]);
                        }
                    }
                    Op::Reopen => {
                        drop(store);
                        store = open(&dev).await;
                        assert_consistent(&store).await;
                    }
                }
                let names: Vec<String> = store.list("").iter().map(|o| o.name.clone()).collect();
                assert_eq!(names, model.keys().cloned().collect::<Vec<_>>());
            }
        });
    }
}

/// Many tasks at once: each owns some names and puts/replaces/deletes them while
/// readers hammer a shared object that is replaced and deleted under them. Readers
/// must see whole, correct objects or NotFound (never a checksum error from reused
/// space), and the final state must match what each task last committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_puts_deletes_and_reads() {
    let dev = mem_device(24 << 20);
    let store = open(&dev).await;
    let shared = |g: u64| crate::contents(1_000_000 + g, 150_000 + (g as usize % 7) * 10_000);
    store.put("shared", &shared(0)).await.unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Readers: every successful read must be one of the generations ever written.
    let mut readers = Vec::new();
    for r in 0..3u64 {
        let (store, stop) = (store.clone(), stop.clone());
        readers.push(tokio::spawn(async move {
            let mut reads = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Some(info) = store.get("shared") {
                    // Read in two halves with a yield between, so writers run in between.
                    let half = info.len / 2;
                    let a = store.read_object_range(&info, 0, half).await.unwrap();
                    tokio::task::yield_now().await;
                    let b = store
                        .read_object_range(&info, half, info.len - half)
                        .await
                        .unwrap();
                    let whole = [a, b].concat();
                    assert!(
                        (0..200u64).any(|g| whole == shared(g)),
                        "reader {r} saw bytes of no generation"
                    );
                    reads += 1;
                }
                tokio::task::yield_now().await;
            }
            reads
        }));
    }
    // The shared object is replaced and deleted by one task.
    let churn = {
        let store = store.clone();
        tokio::spawn(async move {
            for g in 1..200u64 {
                if g % 10 == 0 {
                    let _ = store.delete("shared").await;
                } else {
                    store.put("shared", &shared(g)).await.unwrap();
                }
            }
        })
    };
    // Writers with their own names.
    let mut writers = Vec::new();
    for w in 0..4u64 {
        let store = store.clone();
        writers.push(tokio::spawn(async move {
            let mut last: BTreeMap<String, Option<Vec<u8>>> = BTreeMap::new();
            for step in 0..60u64 {
                let name = format!("w{w}/{}", step % 5);
                if step % 4 == 3 {
                    let ok = store.delete(&name).await.is_ok();
                    assert_eq!(ok, last.get(&name).is_some_and(|v| v.is_some()), "{name}");
                    last.insert(name, None);
                } else {
                    let d =
                        crate::contents(w * 1000 + step, 20_000 + (step as usize * 3001) % 90_000);
                    match store.put(&name, &d).await {
                        Ok(_) => {
                            last.insert(name, Some(d));
                        }
                        Err(Error::ResourcesExhausted(_)) => {}
                        Err(e) => panic!("{name}: {e}"),
                    }
                }
            }
            last
        }));
    }
    churn.await.unwrap();
    let mut expected = BTreeMap::new();
    for w in writers {
        expected.extend(w.await.unwrap());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let reads: u64 = futures::future::join_all(readers)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .sum();
    assert!(reads > 10, "readers made too little progress ({reads})");
    for reopened in [false, true] {
        let store = if reopened {
            open(&dev).await
        } else {
            store.clone()
        };
        for (name, want) in &expected {
            match (store.get_all(name).await, want) {
                (Ok(b), Some(d)) => assert_eq!(&b[..], &d[..], "{name}"),
                (Err(Error::NotFound(_)), None) => {}
                (r, w) => panic!(
                    "{name}: got {:?}, want {:?}",
                    r.map(|b| b.len()),
                    w.as_ref().map(|d| d.len())
                ),
            }
        }
        assert_consistent(&store).await;
    }
}

/// The read cache answers a range read again from memory with the bytes verified
/// when first read (a later flip on the device does not reach it; an uncached range
/// over the flip is still refused), and never answers for a replaced or deleted
/// object.
#[tokio::test]
async fn the_read_cache_serves_repeats_and_never_a_replaced_object() {
    let dev = mem_device(16 << 20);
    let store = open(&dev).await;
    assert_eq!(store.stats().await.read_cache.capacity, 0);
    store.set_read_cache(4 << 20, None);
    let data = crate::contents(3, 300_000);
    let info = store.put("t/p/x", &data).await.unwrap();
    let read = async |off: u64, len: u64| store.read_range("t/p/x", off, len).await;
    assert_eq!(
        &read(1_000, 50_000).await.unwrap()[..],
        &data[1_000..51_000]
    );
    let s = store.stats().await.read_cache;
    assert_eq!((s.hits, s.misses, s.capacity), (0, 1, 4 << 20), "{s:?}");
    assert_eq!(
        &read(1_000, 50_000).await.unwrap()[..],
        &data[1_000..51_000]
    );
    assert_eq!(store.stats().await.read_cache.hits, 1);
    // Damage under the cached range: the cached, verified bytes are still right;
    // another range over the damage goes to the device and is refused.
    let lba = info.extents[0].lba + 2;
    let mut b = dev.read(lba, DmaBuf::zeroed(4096)).await.unwrap();
    b[9] ^= 0x10;
    dev.write(lba, b).await.unwrap();
    assert_eq!(
        &read(1_000, 50_000).await.unwrap()[..],
        &data[1_000..51_000]
    );
    let e = read(8_000, 10).await.unwrap_err();
    assert!(matches!(e, Error::Corrupt(_)), "{e}");
    // Replaced: the same range reads the new bytes.
    let new = crate::contents(4, 300_000);
    store.put("t/p/x", &new).await.unwrap();
    assert_eq!(&read(1_000, 50_000).await.unwrap()[..], &new[1_000..51_000]);
    store.delete("t/p/x").await.unwrap();
    assert!(matches!(read(1_000, 50_000).await, Err(Error::NotFound(_))));
    let s = store.stats().await.read_cache;
    assert!(s.bytes > 0 && s.bytes <= 4 << 20, "{s:?}");
}

/// Inside a memory budget, the read cache holds every range it keeps in the ledger,
/// gives it back as ranges leave, keeps nothing the budget has no room for, and lets
/// go of everything when other work's hold does not fit.
#[tokio::test]
async fn the_read_cache_lives_inside_the_memory_budget() {
    use csd_runtime::memory::MemoryLedger;
    let mib = 1u64 << 20;
    let dev = mem_device(64 << 20);
    let store = open(&dev).await;
    fn quiet() -> Option<u64> {
        Some(0)
    }
    // 64 MiB budget: 56 usable beside the margin.
    let ledger = MemoryLedger::measuring(64 * mib, quiet);
    store.set_read_cache(32 * mib, Some(ledger.clone()));
    let data = crate::contents(5, 12 << 20);
    store.put("t/p/x", &data).await.unwrap();
    for i in 0..12u64 {
        let r = store.read_range("t/p/x", i * mib, mib).await.unwrap();
        assert_eq!(&r[..], &data[(i * mib) as usize..((i + 1) * mib) as usize]);
    }
    let s = store.stats().await.read_cache;
    assert!(s.bytes >= 8 * mib, "{s:?}");
    assert_eq!(ledger.held(), s.bytes, "every kept byte is held, no more");
    // Another hold that needs the cache's room: the cache lets go, the hold fits.
    let upload = ledger
        .hold(56 * mib, "an upload", std::time::Duration::from_secs(5))
        .await
        .expect("the cache makes room");
    assert_eq!(store.stats().await.read_cache.bytes, 0);
    assert_eq!(ledger.held(), 56 * mib);
    // With no room left the cache keeps nothing; the reads still answer.
    let r = store.read_range("t/p/x", 0, mib).await.unwrap();
    assert_eq!(&r[..], &data[..mib as usize]);
    assert_eq!(ledger.held(), 56 * mib);
    drop(upload);
    store.read_range("t/p/x", 0, mib).await.unwrap();
    assert_eq!(ledger.held(), mib, "kept again once there is room");
}

/// A kept result (a transient table) is written within the memory its writer holds:
/// its row groups end once their pages reach a third of it.
#[tokio::test]
async fn a_kept_result_is_written_within_its_memory() {
    use arrow::array::{ArrayRef, Int64Array};
    use arrow::datatypes::{DataType, Field, Schema};
    use arrow::record_batch::RecordBatch;
    use csd_runtime::table::{ParquetOptions, TableStore};

    let dev = mem_device(256 << 20);
    // Row groups as large as the whole result, but for the memory bound.
    let options = ParquetOptions {
        row_group_rows: 1 << 20,
        ..ParquetOptions::default()
    };
    let tables = TableStore::open(open(&dev).await, &options).await.unwrap();
    let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
    // 8 MiB of distinct values: incompressible enough that LZ4 keeps most of it.
    let batches = |n: i64| {
        let schema = schema.clone();
        futures::stream::iter((0..n).map(move |i| {
            let v: Vec<i64> = (0..65_536)
                .map(|j| (i * 65_536 + j).wrapping_mul(0x1E37_79B9_7F4A_7C15))
                .collect();
            Ok(RecordBatch::try_new(
                schema.clone(),
                vec![Arc::new(Int64Array::from(v)) as ArrayRef],
            )
            .unwrap())
        }))
    };
    let tight = tables
        .append_transient("csd_ref_t", "a", schema.clone(), batches(16), 3 << 20)
        .await
        .unwrap();
    let roomy = tables
        .append_transient("csd_ref_t", "b", schema.clone(), batches(16), 1 << 30)
        .await
        .unwrap();
    assert_eq!((tight.rows, roomy.rows), (1 << 20, 1 << 20));
    assert!(
        tight.row_groups >= 4 && roomy.row_groups == 1,
        "row groups within 3 MiB: {}, within 1 GiB: {}",
        tight.row_groups,
        roomy.row_groups
    );
}

/// A one-column table's schema (`v Int64`) and its 1,000 rows from `from`.
fn thousand_ints() -> (
    arrow::datatypes::SchemaRef,
    impl Fn(i64) -> csd_runtime::Result<arrow::record_batch::RecordBatch>,
) {
    use arrow::array::{ArrayRef, Int64Array};
    use arrow::datatypes::{DataType, Field, Schema};
    let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
    let batch = {
        let schema = schema.clone();
        move |from: i64| {
            Ok(arrow::record_batch::RecordBatch::try_new(
                schema.clone(),
                vec![Arc::new(Int64Array::from_iter_values(from..from + 1000)) as ArrayRef],
            )
            .unwrap())
        }
    };
    (schema, batch)
}

/// One object whose footer is damaged at rest: the node's tables still open, its
/// partition reads as DATA_LOSS naming the object, the other partitions as before,
/// and putting the partition again heals it.
#[tokio::test]
async fn a_lost_object_loses_its_partition_not_the_node() {
    use csd_runtime::table::{ParquetOptions, TableStore};

    let dev = mem_device(64 << 20);
    let options = ParquetOptions::default();
    let (schema, batch) = thousand_ints();
    let lost = {
        let tables = TableStore::open(open(&dev).await, &options).await.unwrap();
        for (p, from) in [("p0", 0), ("p1", 1000)] {
            tables
                .append("t", p, schema.clone(), futures::stream::iter([batch(from)]))
                .await
                .unwrap();
        }
        tables.object_store().list("t/p1/")[0].clone()
    };
    // Garbage over the object's last data block (its footer).
    let bs = 4096;
    let mut last = lost.len.div_ceil(bs) - 1;
    let mut lba = None;
    for e in &lost.extents {
        if last < e.blocks {
            lba = Some(e.lba + last);
            break;
        }
        last -= e.blocks;
    }
    let lba = lba.unwrap();
    dev.write(lba, DmaBuf::from_slice(&[0xA5; 4096]))
        .await
        .unwrap();
    dev.flush().await.unwrap();

    let tables = TableStore::open(open(&dev).await, &options).await.unwrap();
    let t = tables.table("t").unwrap();
    assert_eq!(t.objects_of(&["p0"]).unwrap().len(), 1);
    for named in [&["p1"][..], &[]] {
        let e = t.objects_of(named).unwrap_err();
        assert!(
            matches!(e, Error::Corrupt(_)) && e.to_string().contains(&lost.name),
            "{e}"
        );
    }
    assert!(matches!(t.objects_of(&["p9"]), Err(Error::NotFound(_))));
    // Put again, the partition reads.
    tables.delete("t", Some("p1"), &[]).await.unwrap();
    tables
        .append(
            "t",
            "p1",
            schema.clone(),
            futures::stream::iter([batch(1000)]),
        )
        .await
        .unwrap();
    assert_eq!(tables.table("t").unwrap().objects_of(&[]).unwrap().len(), 2);
}

/// A scrub reads every chunk from the device (not the read cache), names each
/// damaged range and goes on, and the node's figures count it and the refused reads.
#[tokio::test]
async fn a_scrub_finds_damage_a_cached_read_would_hide() {
    let dev = mem_device(16 << 20);
    let store = open(&dev).await;
    store.set_read_cache(8 << 20, None);
    let data = crate::contents(9, 300_000);
    let damaged = store.put("t/p/a", &data).await.unwrap();
    store.put("t/p/b", &data).await.unwrap();
    let clean = store.scrub("").await.unwrap();
    assert_eq!(
        (clean.objects, clean.bytes, clean.damaged_count),
        (2, 600_000, 0)
    );
    // Read once (now cached), then damaged at rest in two chunks.
    let range = store.read_range("t/p/a", 70_000, 100).await.unwrap();
    flip(&dev, damaged.extents[0].lba + 1, &[3]).await;
    flip(&dev, damaged.extents[0].lba + 20, &[3]).await;
    assert_eq!(
        store.read_range("t/p/a", 70_000, 100).await.unwrap(),
        range,
        "the cache still answers"
    );
    let found = store.scrub("").await.unwrap();
    assert_eq!((found.objects, found.damaged_count), (2, 2), "{found:?}");
    assert!(
        found.damaged.iter().all(|d| d.contains("t/p/a")),
        "{:?}",
        found.damaged
    );
    assert_eq!(found.bytes, 600_000 - 2 * 65_536);
    assert_eq!(store.scrub("t/p/b").await.unwrap().damaged_count, 0);
    // A read of the damage is refused and counted.
    assert!(store.read_range("t/p/a", 5_000, 10).await.is_err());
    let s = store.stats().await;
    assert_eq!((s.scrub.runs, s.scrub.damaged_count), (3, 2));
    assert_eq!(s.corrupt_reads, 1);
}

/// A paced scrub asks its pace for a turn before each piece, holds the turn while
/// the piece is read, and stops where the pace says stop, reporting what it checked.
#[tokio::test]
async fn a_paced_scrub_reads_each_piece_in_its_turn_and_can_be_stopped() {
    use csd_runtime::store::{Pace, Turn};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts turns and pieces' bytes; `held` counts turns not yet given back.
    struct Counting {
        turns: usize,
        bytes: u64,
        stop_after: usize,
        held: Arc<AtomicUsize>,
    }
    struct Held(Arc<AtomicUsize>);
    impl Drop for Held {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    impl Pace for Counting {
        type Turn = Held;
        async fn turn(&mut self, bytes: u64) -> Turn<Held> {
            assert_eq!(self.held.load(Ordering::SeqCst), 0, "one piece at a time");
            if self.turns == self.stop_after {
                return Turn::Stop;
            }
            self.turns += 1;
            self.bytes += bytes;
            self.held.fetch_add(1, Ordering::SeqCst);
            Turn::Go(Held(self.held.clone()))
        }
    }

    let dev = mem_device(32 << 20);
    let store = open(&dev).await;
    // 2.5 MiB and 1.5 MiB: pieces of 1 MiB, 3 + 2 of them.
    store
        .put("t/p/a", &crate::contents(3, 5 << 19))
        .await
        .unwrap();
    store
        .put("t/p/b", &crate::contents(4, 3 << 19))
        .await
        .unwrap();
    let held = Arc::new(AtomicUsize::new(0));
    let mut all = Counting {
        turns: 0,
        bytes: 0,
        stop_after: usize::MAX,
        held: held.clone(),
    };
    let whole = store.scrub_paced("", &mut all).await.unwrap();
    assert_eq!((all.turns, all.bytes), (5, 4 << 20));
    assert_eq!(
        (whole.objects, whole.bytes, whole.damaged_count),
        (2, 4 << 20, 0)
    );
    assert_eq!(held.load(Ordering::SeqCst), 0);
    let mut some = Counting {
        turns: 0,
        bytes: 0,
        stop_after: 2,
        held,
    };
    let part = store.scrub_paced("", &mut some).await.unwrap();
    assert_eq!(part.bytes, 2 << 20, "{part:?}");
    assert_eq!(store.stats().await.scrub.runs, 2);
}

/// A remembered delete (`csd rm` with a node out of reach) outlives the node's
/// restart and keeps its partition's other puts; one remembered but not yet done
/// when the node stopped is finished when it starts.
#[tokio::test]
async fn a_remembered_delete_is_kept_and_finished() {
    use csd_runtime::protocol::DeletedCopy;
    use csd_runtime::table::{ParquetOptions, TableStore};

    let dev = mem_device(64 << 20);
    let options = ParquetOptions::default();
    let (schema, batch) = thousand_ints();
    let copy_of = |tables: &TableStore, p: &str| DeletedCopy {
        partition: p.into(),
        digests: tables.table("t").unwrap().partitions[p]
            .iter()
            .map(|o| o.object.digest())
            .collect(),
    };
    let (p0, p1) = {
        let tables = TableStore::open(open(&dev).await, &options).await.unwrap();
        for (p, from) in [("p0", 0), ("p1", 1000)] {
            tables
                .append("t", p, schema.clone(), futures::stream::iter([batch(from)]))
                .await
                .unwrap();
        }
        let (p0, p1) = (copy_of(&tables, "p0"), copy_of(&tables, "p1"));
        // p0 deleted here, remembered; p1 remembered as if the node stopped right
        // after (its own copy not yet deleted), written as the node writes it.
        assert_eq!(
            tables
                .delete("t", Some("p0"), std::slice::from_ref(&p0))
                .await
                .unwrap(),
            1
        );
        let store = tables.object_store();
        store
            .put("t/p1/00000099.deleted", &serde_json::to_vec(&p1).unwrap())
            .await
            .unwrap();
        // Remembering a copy it never held is no error.
        let other = DeletedCopy {
            partition: "p7".into(),
            digests: vec![1, 2],
        };
        assert_eq!(tables.delete("t", Some("p7"), &[other]).await.unwrap(), 0);
        (p0, p1)
    };
    let tables = TableStore::open(open(&dev).await, &options).await.unwrap();
    assert!(matches!(tables.table("t"), Err(Error::NotFound(_))));
    let remembered = tables.deleted_of("t");
    assert!(
        remembered.contains(&p0) && remembered.contains(&p1),
        "{remembered:?}"
    );
    assert_eq!(tables.deleted_tables(), vec!["t".to_string()]);
    // A new put of p0 is not the deleted copy, and is kept.
    tables
        .append(
            "t",
            "p0",
            schema.clone(),
            futures::stream::iter([batch(5000)]),
        )
        .await
        .unwrap();
    drop(tables);
    let tables = TableStore::open(open(&dev).await, &options).await.unwrap();
    assert_eq!(tables.table("t").unwrap().partitions.len(), 1);
    assert_eq!(tables.deleted_of("t").len(), 3);
}
