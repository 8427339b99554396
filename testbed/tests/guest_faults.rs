//! The fault loop on a real device path: a node in a QEMU guest drives an emulated
//! NVMe controller through io_uring passthrough, and QEMU's `blkdebug` fails the
//! controller's I/O underneath it, per seed: reads of sectors inside stored
//! objects (latent sector errors, some only once), writes of sectors where new
//! objects will land, flushes and deallocations. While the faults stand the seed
//! stores, replaces and deletes tables, scans them whole and by column, runs pushed
//! down and plain SQL over them, scrubs, and sometimes kills the machine mid-upload;
//! then the guest is killed and booted without faults. The oracle:
//! - under faults, every answer about an acknowledged table is exact, or DATA_LOSS
//!   naming the table — and only where one of the table's own sectors fails to read;
//!   every other table reads exactly (one bad sector loses one object);
//! - a put, replace or delete that failed says so (never an OK over a failed write
//!   or flush); the scrub reports every object holding a failing sector and no other,
//!   and the node's figures count the refused reads;
//! - after the reboot every acknowledged table reads back exactly (the faults
//!   damaged no stored byte), an acknowledged delete or replace never comes back, an
//!   unacknowledged change is whole or absent, and a scrub finds nothing.
//!
//! Runs 1 seed by default (about 100 s on 2 cores); `CSD_FAULT_SEEDS=N` runs N,
//! `CSD_FAULT_SEED=S` replays one. Needs `scripts/setup-qemu.sh`, like
//! `tests/guest.rs`.

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use arrow::array::{Array, Int64Array, StringArray};
use arrow::datatypes::DataType;
use arrow::record_batch::RecordBatch;
use csd_query_pushdown::{Cluster, SessionOptions};
use csd_runtime::StatusCode;
use csd_runtime::node_client::NodeClient;
use csd_testbed::guest::{FaultedIo, Guest, GuestSpec, MediaFault, default_binary};
use futures::TryStreamExt;

/// Seeds the default suite runs.
const DEFAULT_SEEDS: u64 = 1;
/// Rounds (faults on, then a clean reboot) per seed.
const ROUNDS: usize = 2;
/// Steps under faults per round.
const STEPS: u64 = 14;
/// Bytes of the guest's namespace.
const DISK: u64 = 512 << 20;

mod common;
use common::kit;

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        splitmix(&mut self.0) % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// The rows a put stored: `rows` rows made from `seed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Data {
    seed: i64,
    rows: usize,
}

impl Data {
    fn batch(self) -> RecordBatch {
        common::batch(self.seed, self.rows)
    }
}

/// A table as its puts left it: one object per put (empty: no such table).
type Contents = Vec<Data>;

fn batches(c: &[Data]) -> Vec<RecordBatch> {
    c.iter().map(|d| d.batch()).collect()
}

/// `count(*), sum(id), max(text)` of a table's rows, as SQL gives them.
fn summary_of(c: &[Data]) -> (i64, i64, String) {
    let (mut n, mut sum, mut max) = (0i64, 0i64, String::new());
    for b in batches(c) {
        let ids = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
        let text = b.column(1).as_any().downcast_ref::<StringArray>().unwrap();
        n += b.num_rows() as i64;
        sum += ids.values().iter().sum::<i64>();
        if let Some(m) = text.iter().flatten().max()
            && m > max.as_str()
        {
            max = m.to_string();
        }
    }
    (n, sum, max)
}

/// Panics with `what`, the row counts and the first difference unless `got` holds
/// `want`'s rows (`columns` of them).
fn assert_rows(got: &[RecordBatch], want: &[Data], columns: usize, what: &str) {
    let (got, want_rows) = (rows_of(got, columns), rows_of(&batches(want), columns));
    if got != want_rows {
        let first = got.iter().zip(&want_rows).position(|(a, b)| a != b);
        panic!(
            "{what}: {} rows read, {} stored ({want:?}); first difference at {first:?}: {:?} vs {:?}",
            got.len(),
            want_rows.len(),
            first.map(|i| &got[i]),
            first.map(|i| &want_rows[i]),
        );
    }
}

fn trace() -> bool {
    std::env::var_os("CSD_FAULT_TRACE").is_some()
}

fn rows_of(batches: &[RecordBatch], columns: usize) -> Vec<(i64, Option<String>)> {
    let mut out = Vec::new();
    for b in batches {
        let ids = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
        let text =
            (columns > 1).then(|| b.column(1).as_any().downcast_ref::<StringArray>().unwrap());
        for i in 0..b.num_rows() {
            out.push((ids.value(i), text.map(|t| t.value(i).to_string())));
        }
    }
    out.sort();
    out
}

/// What the seed was told: acknowledged contents, deletes, and changes whose outcome
/// it does not know (each with the contents the table may have; empty: absent).
#[derive(Default)]
struct Model {
    acked: BTreeMap<String, Contents>,
    deleted: BTreeSet<String>,
    in_doubt: BTreeMap<String, Vec<Contents>>,
    next: u64,
}

impl Model {
    fn settle(&mut self, table: &str, to: Contents) {
        self.in_doubt.remove(table);
        if to.is_empty() {
            self.acked.remove(table);
            self.deleted.insert(table.into());
        } else {
            self.acked.insert(table.into(), to);
            self.deleted.remove(table);
        }
    }

    /// A change to `table` (acknowledged or new) whose outcome is unknown: it holds
    /// what it held, or `after`.
    fn doubt(&mut self, table: &str, after: Contents) {
        let before = self.acked.remove(table).unwrap_or_default();
        self.deleted.remove(table);
        self.in_doubt.insert(table.into(), vec![before, after]);
    }
}

/// What the loop saw, over all seeds.
#[derive(Default, Debug)]
struct Report {
    seeds: u64,
    steps: u64,
    boots: u64,
    kills_mid_put: u64,
    faults: BTreeMap<String, u64>,
    puts_acked: u64,
    puts_failed: u64,
    deletes_acked: u64,
    deletes_failed: u64,
    answers_exact: u64,
    answers_lost: u64,
    scrub_damaged: u64,
    in_doubt_settled: u64,
}

/// A put of `data` as `table`'s only partition.
async fn put(c: &NodeClient, table: &str, data: Data) -> Result<(), (Option<tonic::Code>, String)> {
    let b = data.batch();
    c.put(table, "p0", b.schema(), futures::stream::iter(vec![Ok(b)]))
        .await
        .map(|_| ())
        .map_err(|e| (e.code(), e.to_string()))
}

/// A scan of `table` (`columns` of its 2), as a status code and message on error.
async fn scan(
    c: &NodeClient,
    table: &str,
    columns: usize,
) -> Result<Vec<RecordBatch>, (Option<tonic::Code>, String)> {
    let projection: &[&str] = if columns == 1 { &["id"] } else { &[] };
    let s = c
        .scan(table, None, projection)
        .await
        .map_err(|e| (e.code(), e.to_string()))?;
    s.try_collect().await.map_err(|e| {
        let e = csd_runtime::node_client::Error::from(e);
        (e.code(), e.to_string())
    })
}

/// `count(*), sum(id), max(text)` of `table` through the SQL session, pushed down or
/// not.
async fn summary(
    url: &str,
    table: &str,
    pushdown: bool,
) -> Result<(i64, i64, String), (StatusCode, String)> {
    let cluster = Cluster::connect(&[url.to_string()])
        .await
        .map_err(|e| (csd_query_pushdown::error::status_code(&e), e.to_string()))?;
    let session = cluster
        .session(SessionOptions {
            pushdown,
            ..SessionOptions::default()
        })
        .await
        .map_err(|e| (csd_query_pushdown::error::status_code(&e), e.to_string()))?;
    let run = session
        .run(&format!("SELECT count(*), sum(id), max(text) FROM {table}"))
        .await
        .map_err(|e| (csd_query_pushdown::error::status_code(&e), e.to_string()))?;
    let b = &run.batches[0];
    let n = arrow::compute::cast(b.column(0), &DataType::Int64).unwrap();
    let s = arrow::compute::cast(b.column(1), &DataType::Int64).unwrap();
    let m = arrow::compute::cast(b.column(2), &DataType::Utf8).unwrap();
    let int = |a: &dyn Array| a.as_any().downcast_ref::<Int64Array>().unwrap().value(0);
    let text = m
        .as_any()
        .downcast_ref::<StringArray>()
        .unwrap()
        .value(0)
        .to_string();
    Ok((int(&n), int(&s), text))
}

/// An object where it lies: its name, its length, and the namespace's byte ranges
/// holding it, in order.
type Placement = (String, u64, Vec<(u64, u64)>);

/// Where each object of the node lies.
async fn placements(c: &NodeClient) -> Vec<Placement> {
    let block = c.stats().await.unwrap().device.geometry.block_size as u64;
    c.objects("")
        .await
        .unwrap()
        .into_iter()
        .map(|o| {
            let ranges = o
                .extents
                .iter()
                .map(|e| (e.lba * block, (e.lba + e.blocks) * block))
                .collect();
            (o.name, o.len, ranges)
        })
        .collect()
}

/// Byte `offset` of an object laid out over `ranges`, on the namespace.
fn byte_on_disk(ranges: &[(u64, u64)], mut offset: u64) -> Option<u64> {
    for (start, end) in ranges {
        if offset < end - start {
            return Some(start + offset);
        }
        offset -= end - start;
    }
    None
}

/// The objects of `placed` holding a sector one of `faults` fails to read.
fn objects_failing_reads(
    placed: &[Placement],
    faults: &[MediaFault],
    persistent_only: bool,
) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for f in faults {
        if f.io != FaultedIo::Read || (persistent_only && f.once) {
            continue;
        }
        let Some(at) = f.at else { continue };
        let sector = at / 512 * 512;
        for (name, len, ranges) in placed {
            // Only sectors inside the object's bytes count: the store reads no further.
            let inside = ranges.iter().scan(0u64, |seen, (s, e)| {
                let r = (*s, *e, *seen);
                *seen += e - s;
                Some(r)
            });
            for (s, e, seen) in inside {
                let end = e.min(s + len.saturating_sub(seen));
                if sector + 512 > s && sector < end {
                    out.insert(name.clone());
                }
            }
        }
    }
    out
}

fn table_of(object: &str) -> &str {
    object.split('/').next().unwrap_or(object)
}

/// The faults of one round: failing reads inside stored objects, failing writes
/// where the next objects will go, sometimes a flush or a deallocation.
fn pick_faults(rng: &mut Rng, placed: &[Placement]) -> Vec<MediaFault> {
    let mut faults = Vec::new();
    let readable: Vec<_> = placed.iter().filter(|(_, len, _)| *len > 0).collect();
    for _ in 0..rng.below(4) {
        if readable.is_empty() {
            break;
        }
        let (_, len, ranges) = readable[rng.below(readable.len() as u64) as usize];
        if let Some(at) = byte_on_disk(ranges, rng.below(*len)) {
            let f = MediaFault::read(at);
            faults.push(if rng.chance(30) { f.once() } else { f });
        }
    }
    let used_end = placed
        .iter()
        .flat_map(|(_, _, r)| r.iter().map(|(_, e)| *e))
        .max()
        .unwrap_or(1 << 20);
    for _ in 0..rng.below(3) {
        let at = (used_end + rng.below(24 << 20)).min(DISK - 512);
        let f = MediaFault::write(at);
        faults.push(if rng.chance(50) { f.once() } else { f });
    }
    if rng.chance(25) {
        faults.push(MediaFault::flush().once());
    }
    if rng.chance(20) && !readable.is_empty() {
        let (_, _, ranges) = readable[rng.below(readable.len() as u64) as usize];
        if let Some((s, _)) = ranges.first() {
            faults.push(MediaFault::discard(*s));
        }
    }
    faults
}

fn fault_kind(f: &MediaFault) -> String {
    format!("{:?}{}", f.io, if f.once { " once" } else { "" })
}

async fn boot(dir: &std::path::Path) -> Guest {
    let mut spec = GuestSpec::new(
        default_binary().unwrap(),
        dir.join("node.img"),
        dir.to_path_buf(),
    );
    spec.disk_bytes = DISK;
    spec.node_args = vec!["--memory".into(), "256MiB".into()];
    Guest::boot(spec).await.unwrap()
}

/// Every table of the model as the reboot left it: acknowledged ones exact, deletes
/// gone, changes in doubt whole or absent (and settled to what is there).
async fn check_after_reboot(c: &NodeClient, m: &mut Model, r: &mut Report, ctx: &str) {
    let present: BTreeSet<String> = c
        .list_tables("")
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect();
    for (t, d) in m.acked.clone() {
        let got = scan(c, &t, 2)
            .await
            .unwrap_or_else(|e| panic!("{ctx}: acknowledged table {t} after the reboot: {e:?}"));
        assert_rows(
            &got,
            &d,
            2,
            &format!("{ctx}: acknowledged table {t} after the reboot"),
        );
        r.answers_exact += 1;
    }
    for t in &m.deleted {
        assert!(
            !present.contains(t),
            "{ctx}: {t} was deleted, acknowledged, and is back"
        );
    }
    for (t, states) in std::mem::take(&mut m.in_doubt) {
        let now = if present.contains(&t) {
            let got = scan(c, &t, 2).await.unwrap_or_else(|e| {
                panic!("{ctx}: table {t} (change in doubt) after the reboot: {e:?}")
            });
            let rows = rows_of(&got, 2);
            let whole = states
                .iter()
                .find(|c| rows_of(&batches(c), 2) == rows)
                .unwrap_or_else(|| {
                    panic!("{ctx}: table {t} after a change in doubt holds {} rows, none of its states {states:?}", rows.len())
                });
            whole.clone()
        } else {
            assert!(
                states.iter().any(|c| c.is_empty()),
                "{ctx}: table {t} vanished, states {states:?}"
            );
            Vec::new()
        };
        m.settle(&t, now);
        r.in_doubt_settled += 1;
    }
    let scrub = c.scrub("").await.unwrap();
    assert_eq!(
        scrub.damaged_count, 0,
        "{ctx}: a scrub without faults found {:?}",
        scrub.damaged
    );
}

/// One step under faults.
async fn step(
    g: &Guest,
    c: &NodeClient,
    m: &mut Model,
    rng: &mut Rng,
    r: &mut Report,
    failing: &BTreeSet<String>,
    ctx: &str,
) {
    let tables: Vec<String> = m.acked.keys().cloned().collect();
    let pick = |rng: &mut Rng| tables.get(rng.below(tables.len() as u64) as usize).cloned();
    match rng.below(10) {
        // A new table, or a replace of one.
        0..=3 => {
            let table = match pick(rng) {
                Some(t) if rng.chance(30) => t,
                _ => {
                    m.next += 1;
                    format!("t{}", m.next)
                }
            };
            let rows = [300, 6_000, 60_000, 140_000][rng.below(4) as usize];
            let data = Data {
                seed: rng.below(1 << 20) as i64,
                rows,
            };
            let done = put(c, &table, data).await;
            if trace() {
                eprintln!("{ctx}: put {table} {data:?}: {done:?}");
            }
            let mut after = m.acked.get(&table).cloned().unwrap_or_default();
            after.push(data);
            match done {
                Ok(()) => {
                    m.settle(&table, after);
                    r.puts_acked += 1;
                }
                Err((code, msg)) => {
                    // A put the drive failed lost nothing stored.
                    assert_ne!(
                        code,
                        Some(tonic::Code::DataLoss),
                        "{ctx}: put {table}: {msg}"
                    );
                    m.doubt(&table, after);
                    r.puts_failed += 1;
                }
            }
        }
        4 => {
            let Some(table) = pick(rng) else { return };
            let done = c.delete(&table, None).await;
            if trace() {
                eprintln!("{ctx}: delete {table}: {done:?}");
            }
            match done {
                Ok(_) => {
                    m.settle(&table, Vec::new());
                    r.deletes_acked += 1;
                }
                Err(_) => {
                    m.doubt(&table, Vec::new());
                    r.deletes_failed += 1;
                }
            }
        }
        5..=7 => {
            let Some(table) = pick(rng) else { return };
            let d = m.acked[&table].clone();
            let columns = 1 + rng.below(2) as usize;
            let done = scan(c, &table, columns).await;
            if trace() {
                eprintln!(
                    "{ctx}: scan {table} ({columns} columns): {:?}",
                    done.as_ref()
                        .map(|b| b.iter().map(|b| b.num_rows()).sum::<usize>())
                );
            }
            match done {
                Ok(got) => {
                    assert_rows(&got, &d, columns, &format!("{ctx}: scan of {table}"));
                    r.answers_exact += 1;
                }
                Err((code, msg)) => {
                    lost(
                        g,
                        c,
                        &table,
                        failing,
                        code == Some(tonic::Code::DataLoss),
                        &msg,
                        ctx,
                    )
                    .await;
                    r.answers_lost += 1;
                }
            }
        }
        _ => {
            let Some(table) = pick(rng) else { return };
            let d = m.acked[&table].clone();
            let pushdown = rng.chance(70);
            let done = summary(&g.url, &table, pushdown).await;
            if trace() {
                eprintln!("{ctx}: SQL over {table} (pushdown {pushdown}): {done:?}");
            }
            match done {
                Ok(got) => {
                    assert_eq!(
                        got,
                        summary_of(&d),
                        "{ctx}: SQL over {table} (pushdown {pushdown})"
                    );
                    r.answers_exact += 1;
                }
                Err((code, msg)) => {
                    lost(
                        g,
                        c,
                        &table,
                        failing,
                        code == StatusCode::DataLoss,
                        &msg,
                        ctx,
                    )
                    .await;
                    r.answers_lost += 1;
                }
            }
        }
    }
    r.steps += 1;
}

/// A read of `table` failed: it must be DATA_LOSS naming the table, over a sector of
/// its own that fails, on a node that serves on.
async fn lost(
    g: &Guest,
    c: &NodeClient,
    table: &str,
    failing: &BTreeSet<String>,
    data_loss: bool,
    msg: &str,
    ctx: &str,
) {
    assert!(
        data_loss,
        "{ctx}: reading {table} failed, but not as DATA_LOSS: {msg}"
    );
    assert!(
        msg.contains(&format!("{table}/")),
        "{ctx}: the DATA_LOSS of {table} does not name its object: {msg}"
    );
    assert!(
        failing.contains(table),
        "{ctx}: {table} holds no failing sector, yet reading it failed: {msg}\n{}",
        g.log_tail(20)
    );
    c.stats()
        .await
        .unwrap_or_else(|e| panic!("{ctx}: the node stopped serving after {table}'s loss: {e}"));
}

async fn run_seed(seed: u64, r: &mut Report) {
    let ctx0 = format!(
        "seed {seed} (replay: CSD_FAULT_SEED={seed} cargo test --workspace --test guest_faults)"
    );
    let mut rng = Rng(seed);
    let dir = tempfile::tempdir().unwrap();
    let mut g = boot(dir.path()).await;
    r.boots += 1;
    let mut m = Model::default();
    let c = NodeClient::connect(&g.url).await.unwrap();
    for _ in 0..2 + rng.below(4) {
        m.next += 1;
        let table = format!("t{}", m.next);
        let data = Data {
            seed: rng.below(1 << 20) as i64,
            rows: [300, 6_000, 60_000, 140_000][rng.below(4) as usize],
        };
        put(&c, &table, data)
            .await
            .unwrap_or_else(|e| panic!("{ctx0}: a put without faults: {e:?}"));
        m.settle(&table, vec![data]);
        r.puts_acked += 1;
    }
    for round in 0..ROUNDS {
        let ctx = format!("{ctx0}, round {round}");
        let c = NodeClient::connect(&g.url).await.unwrap();
        let placed = placements(&c).await;
        let faults = pick_faults(&mut rng, &placed);
        for f in &faults {
            *r.faults.entry(fault_kind(f)).or_default() += 1;
        }
        eprintln!("{ctx}: {} tables, faults {faults:?}", m.acked.len());
        g.restart_with_faults(faults.clone())
            .await
            .unwrap_or_else(|e| panic!("{ctx}: the node did not start over its faults: {e}"));
        r.boots += 1;
        let c = NodeClient::connect(&g.url).await.unwrap();
        let lost_before = r.answers_lost;
        for _ in 0..STEPS {
            // New objects may land on a failing sector: what fails is read from the
            // catalog each step.
            let placed = placements(&c).await;
            let failing: BTreeSet<String> = objects_failing_reads(&placed, &faults, false)
                .iter()
                .map(|o| table_of(o).to_string())
                .collect();
            step(&g, &c, &mut m, &mut rng, r, &failing, &ctx).await;
        }
        // The node counts the reads it refused.
        let refused = c.stats().await.unwrap().store.corrupt_reads;
        assert!(
            r.answers_lost == lost_before || refused > 0,
            "{ctx}: {} reads answered DATA_LOSS, the node counts {refused}",
            r.answers_lost - lost_before
        );
        // The scrub reports the objects over failing sectors, and no other.
        let placed = placements(&c).await;
        let scrub = c
            .scrub("")
            .await
            .unwrap_or_else(|e| panic!("{ctx}: scrub under faults: {e}"));
        r.scrub_damaged += scrub.damaged_count;
        let may = objects_failing_reads(&placed, &faults, false);
        for d in &scrub.damaged {
            assert!(
                may.iter().any(|o| d.contains(o.as_str())),
                "{ctx}: the scrub reports {d}, over no failing sector ({may:?})"
            );
        }
        for o in objects_failing_reads(&placed, &faults, true) {
            if m.acked.contains_key(table_of(&o)) {
                assert!(
                    scrub.damaged.iter().any(|d| d.contains(o.as_str())),
                    "{ctx}: the scrub missed {o}: {:?}",
                    scrub.damaged
                );
            }
        }
        // Sometimes the machine dies mid-upload.
        if rng.chance(40) {
            m.next += 1;
            let table = format!("t{}", m.next);
            let data = Data {
                seed: rng.below(1 << 20) as i64,
                rows: 140_000,
            };
            m.doubt(&table, vec![data]);
            let writer = {
                let c = c.clone();
                let table = table.clone();
                tokio::spawn(async move { put(&c, &table, data).await })
            };
            tokio::time::sleep(Duration::from_millis(rng.below(1_500))).await;
            g.kill();
            let done = writer.await;
            if trace() {
                eprintln!("{ctx}: put {table} {data:?} cut by a kill: {done:?}");
            }
            if let Ok(Ok(())) = done {
                m.settle(&table, vec![data]);
            }
            r.kills_mid_put += 1;
        }
        g.restart_with_faults(vec![])
            .await
            .unwrap_or_else(|e| panic!("{ctx}: the reboot without faults: {e}"));
        r.boots += 1;
        let c = NodeClient::connect(&g.url).await.unwrap();
        check_after_reboot(&c, &mut m, r, &ctx).await;
    }
    r.seeds += 1;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn media_faults_under_a_guest_node_lose_no_acknowledged_byte() {
    if kit().is_none() {
        return;
    }
    let seeds: Vec<u64> = match std::env::var("CSD_FAULT_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(s) => vec![s],
        None => {
            let n = std::env::var("CSD_FAULT_SEEDS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(DEFAULT_SEEDS);
            (0..n).collect()
        }
    };
    let mut r = Report::default();
    let t = std::time::Instant::now();
    for seed in seeds {
        run_seed(seed, &mut r).await;
    }
    eprintln!(
        "guest fault loop (nvme passthrough under QEMU blkdebug): {} seeds, {} steps, {} boots, {} kills mid-put, {:.0} s\n  \
         faults: {:?}\n  puts acknowledged {}, failed {}; deletes acknowledged {}, failed {}; changes in doubt settled {}\n  \
         answers exact {}, reported lost (DATA_LOSS naming the table, over its own failing sector) {}; scrub damaged ranges {}\n  \
         verdicts: 0 seeds failed",
        r.seeds,
        r.steps,
        r.boots,
        r.kills_mid_put,
        t.elapsed().as_secs_f64(),
        r.faults,
        r.puts_acked,
        r.puts_failed,
        r.deletes_acked,
        r.deletes_failed,
        r.in_doubt_settled,
        r.answers_exact,
        r.answers_lost,
        r.scrub_damaged
    );
    assert!(r.answers_exact > 0);
}
