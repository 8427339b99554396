//! The store over a drive that misbehaves on purpose ([`FaultyDisk`]): per seed, a
//! random schedule of puts (small and multi-chunk objects, replaces), deletes, whole
//! and ranged reads, with the power failing at random commands and the store
//! reopened, against a model of what each name may hold. The oracle, after every
//! step and every restart:
//! - an acknowledged put reads back byte-identical, or fails with DATA_LOSS naming
//!   the object (and only on a seed that damaged bytes);
//! - an acknowledged delete or replace never comes back; an unacknowledged put is
//!   whole or absent;
//! - the catalog survives (one bad object is one object lost);
//! - a flush that failed is not believed: the change it covered fails.
//!
//! `CSD_FAULT_SEEDS=N` runs N seeds (a soak), `CSD_FAULT_SEED=S` replays one; a
//! failing seed prints the line that replays it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use csd_runtime::Error;
use csd_runtime::device::BlockDevice;
use csd_runtime::device::emulated::{EmulatedDevice, TimingModel};
use csd_runtime::device::faulty::{Fault, FaultRates, FaultyDisk};
use csd_runtime::device::uring::UringDevice;
use csd_runtime::store::{ObjectStore, StoreOptions};

/// Seeds the default suite runs.
const DEFAULT_SEEDS: u64 = 200;
/// Steps per seed.
const STEPS: usize = 60;
/// Catalog slot blocks: the store's metadata ends at block 1 + 2 × this.
const SLOT_BLOCKS: u64 = 64;
const NAMES: u64 = 8;

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

/// What one seed's run saw.
#[derive(Default, Debug)]
struct Report {
    ops: u64,
    crashes: u64,
    reopens: u64,
    puts_acked: u64,
    puts_failed: u64,
    reads_exact: u64,
    reads_lost: u64,
    faults: BTreeMap<Fault, u64>,
}

/// The states a name may be in: `None` absent, `Some(bytes)` holding them.
type States = BTreeSet<Option<Arc<Vec<u8>>>>;

struct Sim {
    seed: u64,
    disk: Arc<FaultyDisk>,
    dev: Arc<dyn BlockDevice>,
    model: BTreeMap<String, States>,
    report: Report,
    /// Print every step (`CSD_FAULT_TRACE=1`).
    trace: bool,
    /// A change failed since the store opened: what it wrote may be durable though
    /// the store's catalog in memory does not show it (a flush that failed may have
    /// written it all), so the listing narrows nothing until the next open.
    uncertain: bool,
    /// The store has opened once (its format completed).
    formatted: bool,
}

fn rates(rng: &mut Rng) -> FaultRates {
    // Each fault off, rare or frequent, so seeds cover every mix.
    let mut pick = |rare: f64| match rng.below(3) {
        0 => 0.0,
        1 => rare,
        _ => rare * 10.0,
    };
    FaultRates {
        rot: pick(0.0005),
        corrupt: pick(0.002),
        misdirect: pick(0.002),
        lse: pick(0.002),
        write_eio: pick(0.002),
        enospc: pick(0.002),
        flush_fail: pick(0.005),
        spike: 0.0,
        spike_ms: 0,
    }
}

impl Sim {
    fn fail(&self, what: String) -> String {
        format!(
            "seed {}: {what}\nfaults so far: {:?}\nreplay: CSD_FAULT_SEED={} cargo test -p csd-runtime --test integration sim:: -- --nocapture",
            self.seed,
            self.disk.injected(),
            self.seed
        )
    }

    /// Whether the device has changed stored bytes without failing the command.
    fn damaged(&self) -> bool {
        self.disk
            .injected()
            .iter()
            .any(|(f, n)| *n > 0 && f.damages_durable_data())
    }

    async fn open(&mut self) -> Result<ObjectStore, String> {
        let opts = StoreOptions {
            slot_blocks: SLOT_BLOCKS,
            ..StoreOptions::default()
        };
        // Opening writes too (a blank device's format, a slot's repair): a fault
        // there fails the open, and the node would be started again.
        for _ in 0..20 {
            match ObjectStore::open(self.dev.clone(), opts.clone()).await {
                Ok(s) => {
                    self.uncertain = false;
                    self.formatted = true;
                    return Ok(s);
                }
                Err(Error::Unavailable(_)) if self.disk.is_dead() => self.restart().await?,
                Err(e @ (Error::Io { .. } | Error::ResourcesExhausted(_))) => {
                    tracing::debug!("open failed, again: {e}");
                    self.restart().await?;
                }
                // The very first format torn at block 0 leaves garbage where the
                // superblock goes: the store refuses the device as foreign rather
                // than erase it, and nothing was ever stored, so `--format` it is.
                Err(Error::InvalidArgument(m))
                    if m.contains("not a csd object store") && !self.formatted =>
                {
                    let force = StoreOptions {
                        format: csd_runtime::store::FormatMode::Force,
                        ..opts.clone()
                    };
                    match ObjectStore::open(self.dev.clone(), force).await {
                        Ok(s) => {
                            self.uncertain = false;
                            self.formatted = true;
                            return Ok(s);
                        }
                        Err(_) => self.restart().await?,
                    }
                }
                Err(e) => return Err(self.fail(format!("the store does not open: {e}"))),
            }
        }
        Err(self.fail("the store never opened in 20 tries".into()))
    }

    async fn restart(&mut self) -> Result<(), String> {
        self.report.crashes += 1;
        self.dev = self
            .disk
            .restart()
            .await
            .map_err(|e| self.fail(format!("restart: {e}")))?;
        Ok(())
    }

    /// The catalog against the model: a listed name holds one of its states' bytes,
    /// an unlisted one may be absent.
    fn check_list(&mut self, store: &ObjectStore) -> Result<(), String> {
        let listed: BTreeSet<String> = store.list("").iter().map(|o| o.name.clone()).collect();
        for name in &listed {
            if !self.model.contains_key(name) {
                return Err(self.fail(format!("{name} is listed but was never put")));
            }
        }
        let mut problems = vec![];
        let narrow = !self.uncertain;
        for (name, states) in &mut self.model {
            let here = listed.contains(name);
            let before = states.clone();
            if narrow {
                states.retain(|s| s.is_some() == here);
            }
            if !before.iter().any(|s| s.is_some() == here) {
                states.clear();
            }
            if states.is_empty() {
                problems.push(match here {
                    true => format!("{name} is listed after an acknowledged delete: {before:?}"),
                    false => format!(
                        "{name} is gone though its put was acknowledged ({} possible states)",
                        before.len()
                    ),
                });
            }
        }
        match problems.first() {
            Some(p) => Err(self.fail(p.clone())),
            None => Ok(()),
        }
    }

    /// Reads `name` whole and checks it against the model.
    async fn check_read(&mut self, store: &ObjectStore, name: &str) -> Result<Step, String> {
        let r = store.get_all(name).await;
        let states = self.model.entry(name.to_string()).or_default();
        match r {
            Ok(b) => {
                let got = Some(Arc::new(b.to_vec()));
                if !states.contains(&got) {
                    let sizes: Vec<_> =
                        states.iter().map(|s| s.as_ref().map(|d| d.len())).collect();
                    return Err(self.fail(format!(
                        "SILENT CORRUPTION: {name} read {} bytes matching none of its states {sizes:?}",
                        b.len()
                    )));
                }
                if !self.uncertain {
                    *states = BTreeSet::from([got]);
                }
                self.report.reads_exact += 1;
                Ok(Step::Done)
            }
            Err(Error::NotFound(_)) if states.contains(&None) => {
                if !self.uncertain {
                    *states = BTreeSet::from([None]);
                }
                Ok(Step::Done)
            }
            Err(e) => self.read_error(name, e),
        }
    }

    fn read_error(&mut self, name: &str, e: Error) -> Result<Step, String> {
        match e {
            Error::Corrupt(m) if m.contains(name) && self.damaged() => {
                self.report.reads_lost += 1;
                Ok(Step::Done)
            }
            Error::Unavailable(_) if self.disk.is_dead() => Ok(Step::Crashed),
            e => Err(self.fail(format!("reading {name}: {e:?}"))),
        }
    }

    async fn run(&mut self) -> Result<(), String> {
        let mut rng = Rng(self.seed ^ 0x5151);
        for i in 0..NAMES {
            self.model
                .insert(format!("t/p{i}/o"), BTreeSet::from([None]));
        }
        let mut store = self.open().await?;
        for step in 0..STEPS {
            self.report.ops += 1;
            // The power fails somewhere in the next few commands.
            if rng.chance(12) {
                self.disk.power_fail_after(rng.below(24));
            }
            let name = format!("t/p{}/o", rng.below(NAMES));
            let outcome = match rng.below(100) {
                0..40 => {
                    let len = if rng.chance(70) {
                        rng.below(8 << 10) as usize
                    } else {
                        (64 << 10) + rng.below(600 << 10) as usize
                    };
                    let data = Arc::new(crate::contents(self.seed * 1000 + step as u64, len));
                    let r = store.put(&name, &data).await;
                    if self.trace {
                        println!("put {name} {len} bytes: {:?}", r.as_ref().map(|_| ()));
                    }
                    let states = self.model.entry(name.clone()).or_default();
                    match r {
                        Ok(_) => {
                            *states = BTreeSet::from([Some(data)]);
                            self.report.puts_acked += 1;
                            Step::Done
                        }
                        Err(e) => {
                            states.insert(Some(data));
                            self.report.puts_failed += 1;
                            self.uncertain = true;
                            self.write_failed(e)?
                        }
                    }
                }
                40..55 => {
                    let r = store.delete(&name).await;
                    if self.trace {
                        println!("delete {name}: {:?}", r.as_ref().map(|_| ()));
                    }
                    let states = self.model.entry(name.clone()).or_default();
                    match r {
                        Ok(_) => {
                            *states = BTreeSet::from([None]);
                            Step::Done
                        }
                        Err(Error::NotFound(_)) if states.contains(&None) => {
                            if !self.uncertain {
                                *states = BTreeSet::from([None]);
                            }
                            Step::Done
                        }
                        Err(e) => {
                            states.insert(None);
                            self.uncertain = true;
                            self.write_failed(e)?
                        }
                    }
                }
                55..80 => self.check_read(&store, &name).await?,
                _ => {
                    // A range of an object whose bytes are known.
                    let known = match self.model.get(&name).map(|s| s.iter().collect::<Vec<_>>()) {
                        Some(s) if s.len() == 1 => s[0].clone(),
                        _ => None,
                    };
                    match known {
                        Some(d) if !d.is_empty() => {
                            let off = rng.below(d.len() as u64);
                            let len = 1 + rng.below(d.len() as u64 - off);
                            match store.read_range(&name, off, len).await {
                                Ok(b) if b[..] == d[off as usize..(off + len) as usize] => {
                                    self.report.reads_exact += 1;
                                    Step::Done
                                }
                                Ok(_) => {
                                    return Err(self.fail(format!(
                                        "SILENT CORRUPTION: {name} bytes [{off}, +{len}) differ"
                                    )));
                                }
                                Err(e) => self.read_error(&name, e)?,
                            }
                        }
                        _ => Step::Done,
                    }
                }
            };
            if self.trace {
                println!(
                    "step {step}: {name} → {outcome:?}; faults {:?}",
                    self.disk.injected()
                );
            }
            match outcome {
                Step::Done => self.check_list(&store)?,
                Step::Crashed | Step::Reopen => {
                    if outcome == Step::Reopen {
                        self.report.reopens += 1;
                    }
                    drop(store);
                    if self.disk.is_dead() || outcome == Step::Crashed {
                        self.restart().await?;
                    } else {
                        // The node process restarts; the drive keeps its power.
                        self.dev = self.disk.reattach();
                    }
                    store = self.open().await?;
                    store = self.verify_all(store).await?;
                }
            }
        }
        // The end: power off and on once more, then everything is checked.
        drop(store);
        self.restart().await?;
        let store = self.open().await?;
        self.verify_all(store).await?;
        self.report.faults = self.disk.injected();
        Ok(())
    }

    /// A put or delete that failed: why, and what comes next.
    fn write_failed(&self, e: Error) -> Result<Step, String> {
        match e {
            Error::Unavailable(_) if self.disk.is_dead() => Ok(Step::Crashed),
            // Read-only after a failed flush or catalog write: the node restarts.
            Error::Unavailable(_) => Ok(Step::Reopen),
            Error::Io { .. } | Error::ResourcesExhausted(_) => Ok(Step::Done),
            e => Err(self.fail(format!("a write failed oddly: {e:?}"))),
        }
    }

    /// Checks every name; the power failing meanwhile restarts and checks again.
    /// Returns the store to go on with.
    async fn verify_all(&mut self, mut store: ObjectStore) -> Result<ObjectStore, String> {
        'again: loop {
            self.check_list(&store)?;
            let names: Vec<String> = self.model.keys().cloned().collect();
            for name in names {
                if self.check_read(&store, &name).await? == Step::Crashed {
                    drop(store);
                    self.restart().await?;
                    store = self.open().await?;
                    continue 'again;
                }
            }
            return Ok(store);
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Done,
    Crashed,
    Reopen,
}

/// Where a seed's disk keeps its blocks.
#[derive(Clone, Copy)]
enum Backing {
    Memory,
    /// A file in the test's scratch directory, through io_uring and O_DIRECT.
    Uring,
}

fn run_seed(seed: u64, backing: Backing) -> Result<Report, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rt.block_on(async {
            let mut rng = Rng(seed);
            let dir = crate::scratch_dir();
            let inner: Arc<dyn BlockDevice> = match backing {
                Backing::Memory => Arc::new(
                    EmulatedDevice::open(None, 24 << 20, 4096, TimingModel::untimed())
                        .map_err(|e| e.to_string())?,
                ),
                Backing::Uring => Arc::new(
                    UringDevice::open(&dir.path().join("disk.img"), Some(24 << 20), 32)
                        .map_err(|e| e.to_string())?,
                ),
            };
            let disk = FaultyDisk::new(inner, seed, rates(&mut rng)).map_err(|e| e.to_string())?;
            disk.set_safe_below(1 + 2 * SLOT_BLOCKS);
            let mut sim = Sim {
                seed,
                dev: disk.device(),
                disk,
                model: BTreeMap::new(),
                report: Report::default(),
                trace: std::env::var_os("CSD_FAULT_TRACE").is_some(),
                uncertain: false,
                formatted: false,
            };
            sim.run().await?;
            Ok(sim.report)
        })
    }));
    match result {
        Ok(r) => r,
        Err(p) => Err(format!(
            "seed {seed}: PANIC {:?}\nreplay: CSD_FAULT_SEED={seed} cargo test -p csd-runtime --test integration sim:: -- --nocapture",
            p.downcast_ref::<String>()
                .map(String::as_str)
                .or(p.downcast_ref::<&str>().copied())
        )),
    }
}

#[test]
fn acknowledged_objects_read_back_exactly_or_are_reported_lost() {
    simulate(Backing::Memory, DEFAULT_SEEDS);
}

/// The same over a file through io_uring (fewer seeds: each makes a file).
#[test]
fn the_same_over_io_uring() {
    simulate(Backing::Uring, DEFAULT_SEEDS / 8);
}

fn simulate(backing: Backing, default_seeds: u64) {
    let seeds: Vec<u64> = match std::env::var("CSD_FAULT_SEED") {
        Ok(s) => vec![s.parse().expect("CSD_FAULT_SEED is a number")],
        Err(_) => {
            let n = std::env::var("CSD_FAULT_SEEDS")
                .ok()
                .and_then(|n| n.parse().ok())
                .unwrap_or(default_seeds);
            (1..=n).collect()
        }
    };
    let mut total = Report::default();
    let mut failures = vec![];
    for &seed in &seeds {
        match run_seed(seed, backing) {
            Ok(r) => {
                total.ops += r.ops;
                total.crashes += r.crashes;
                total.reopens += r.reopens;
                total.puts_acked += r.puts_acked;
                total.puts_failed += r.puts_failed;
                total.reads_exact += r.reads_exact;
                total.reads_lost += r.reads_lost;
                for (f, n) in r.faults {
                    *total.faults.entry(f).or_default() += n;
                }
            }
            Err(e) => failures.push(e),
        }
    }
    let over = match backing {
        Backing::Memory => "memory",
        Backing::Uring => "io_uring",
    };
    println!(
        "fault simulation over {over}: {} seeds, {} operations, {} power losses, {} reopens after a failed flush or catalog write",
        seeds.len(),
        total.ops,
        total.crashes,
        total.reopens
    );
    println!(
        "  puts acknowledged {}, failed {}; reads exact {}, reported lost (DATA_LOSS naming the object) {}",
        total.puts_acked, total.puts_failed, total.reads_exact, total.reads_lost
    );
    println!("  faults injected: {:?}", total.faults);
    println!(
        "  verdicts: {} seeds failed (silent corruption, resurrected delete, lost acknowledged object, panic or odd error)",
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    // The schedule really did what it is for.
    if seeds.len() >= 50 {
        assert!(total.crashes > 0 && total.reads_exact > 0 && total.puts_acked > 0);
        for f in [
            Fault::Rot,
            Fault::Corrupt,
            Fault::Misdirect,
            Fault::CachedTorn,
            Fault::FlushFail,
        ] {
            assert!(
                total.faults.get(&f).copied().unwrap_or(0) > 0,
                "no {f:?} injected"
            );
        }
    }
}
