//! The node's memory budget (`--memory`), held against what the process really holds.
//!
//! Operators' working memory (hash tables, sort buffers: what DataFusion's memory
//! pool counts) is only part of a node's memory. Decoded pages and batches, Arrow IPC
//! encoding, gRPC buffers, the catalog and the allocator's slack are not counted by
//! any pool, and under a heavy aggregation they are a third of the process. So the
//! ledger does not trust the pools' count alone: what operators may take is the
//! budget less everything else the process holds, measured from its resident memory
//! (`/proc/self/statm`, sampled at most every [`SAMPLE_EVERY`]). A pool that is
//! refused growth makes its operator give memory back (a partial aggregate emits its
//! groups early) rather than fail.
//!
//! The node's other work holds memory in the same ledger before it allocates it:
//! an upload its decode and row-group buffers, a scan or range stream its read-ahead
//! and encoding, the read cache every range it keeps ([`MemoryLedger::hold`],
//! [`Held`]). All of it fits under the budget together: what operators may take
//! shrinks by what is held, and a hold that does not fit first asks the read cache
//! to let go ([`MemoryLedger::set_reclaimer`]), then waits for memory to be given
//! back, and after its patience is refused with `RESOURCE_EXHAUSTED` and a retry
//! hint, before it has read a byte of its request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use csd_protocol::{ByteSize, Error, Result};

/// How stale the resident-memory sample may be.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(5);

/// The memory outside the pools counts at its highest over this window: it swings
/// with each row group decoded and batch sent, and a pool sized at a trough would
/// overrun the budget at the next crest.
pub const PEAK_WINDOW: Duration = Duration::from_secs(2);

/// Least time between two trims asked for by refused growth
/// ([`MemoryLedger::try_take_or_trim`]).
pub const TRIM_EVERY: Duration = Duration::from_millis(250);

/// Operators may always take this share of the budget, whatever else the process
/// holds (1/8): enough for any operator to make progress, so that a node over its
/// budget for reasons operators cannot change slows down instead of failing queries.
pub const FLOOR_DIVISOR: u64 = 8;

/// What operators leave unused of the budget (1/8), for the memory outside the
/// pools to grow into between samples (the next row group's pages, a batch being
/// encoded).
pub const MARGIN_DIVISOR: u64 = 8;

/// Holds of I/O work may always take this share of the budget together (1/8, what
/// the margin keeps free), whatever else the process holds: uploads and reads make
/// progress, one at a time if need be, on a node whose idle memory (its catalog,
/// I/O buffers, the allocator's slack) fills most of a small budget.
pub const HOLD_FLOOR_DIVISOR: u64 = 8;

/// How often a waiting hold looks again without being woken (resident memory falls
/// without anyone giving a hold back: the allocator returns pages).
const HOLD_POLL: Duration = Duration::from_millis(20);

/// What the read cache is asked to do when memory is short: let go of what it
/// keeps; returns the bytes it let go of.
pub type Reclaimer = Box<dyn Fn() -> u64 + Send + Sync>;

struct ReclaimSlot(OnceLock<Reclaimer>);

impl std::fmt::Debug for ReclaimSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "Some(..)"
        } else {
            "None"
        })
    }
}

/// The node-wide account of operator memory against the budget.
#[derive(Debug)]
pub struct MemoryLedger {
    budget: u64,
    /// Bytes operators' pools hold now.
    pooled: AtomicU64,
    /// Bytes other work holds now ([`Held`], the read cache).
    held: AtomicU64,
    /// Bytes holds are waiting for: operators do not grow into them.
    wanted: AtomicU64,
    /// Woken when held memory is given back.
    freed: tokio::sync::Notify,
    reclaimer: ReclaimSlot,
    /// Highest bytes the process held outside the pools and holds in the current
    /// window.
    outside: AtomicU64,
    /// When the current window began (microseconds since `epoch`).
    window_us: AtomicU64,
    /// When that sample was taken, in microseconds since `epoch` (+1; 0: never).
    sampled_us: AtomicU64,
    /// When the allocator was last asked to return free memory (as `sampled_us`).
    trimmed_us: AtomicU64,
    epoch: Instant,
    resident: fn() -> Option<u64>,
}

impl MemoryLedger {
    /// A ledger for a node with `budget` bytes, measuring this process.
    pub fn new(budget: u64) -> Arc<Self> {
        Self::measuring(budget, resident_bytes)
    }

    /// A ledger whose process memory is what `resident` says (tests).
    pub fn measuring(budget: u64, resident: fn() -> Option<u64>) -> Arc<Self> {
        Arc::new(MemoryLedger {
            budget,
            pooled: AtomicU64::new(0),
            held: AtomicU64::new(0),
            wanted: AtomicU64::new(0),
            freed: tokio::sync::Notify::new(),
            reclaimer: ReclaimSlot(OnceLock::new()),
            outside: AtomicU64::new(0),
            window_us: AtomicU64::new(0),
            sampled_us: AtomicU64::new(0),
            trimmed_us: AtomicU64::new(0),
            epoch: Instant::now(),
            resident,
        })
    }

    /// The budget in bytes.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes operators' pools hold now.
    pub fn pooled(&self) -> u64 {
        self.pooled.load(Ordering::Relaxed)
    }

    /// Bytes held by work other than operators ([`Held`], the read cache).
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// Bytes the process holds outside operators' pools and holds: the highest
    /// sample of the last [`PEAK_WINDOW`] or two (0 where the OS does not say).
    pub fn outside(&self) -> u64 {
        let now = self.epoch.elapsed().as_micros() as u64 + 1;
        let last = self.sampled_us.load(Ordering::Relaxed);
        if last == 0 || now.saturating_sub(last) >= SAMPLE_EVERY.as_micros() as u64 {
            // Several threads may sample at once; any of their samples will do.
            self.sampled_us.store(now, Ordering::Relaxed);
            let outside = (self.resident)()
                .unwrap_or(0)
                .saturating_sub(self.pooled())
                .saturating_sub(self.held());
            let window = self.window_us.load(Ordering::Relaxed);
            if now.saturating_sub(window) >= PEAK_WINDOW.as_micros() as u64 {
                self.window_us.store(now, Ordering::Relaxed);
                self.outside.store(outside, Ordering::Relaxed);
            } else {
                self.outside.fetch_max(outside, Ordering::Relaxed);
            }
        }
        self.outside.load(Ordering::Relaxed)
    }

    /// Bytes operators' pools may hold in all now: the budget less what the process
    /// holds besides (held or not), what holds wait for, and a [`MARGIN_DIVISOR`]th
    /// margin, and never less than a [`FLOOR_DIVISOR`]th of the budget. Holds come
    /// first: an operator refused growth gives memory back, an upload cannot.
    pub fn operator_limit(&self) -> u64 {
        self.usable()
            .saturating_sub(self.outside())
            .saturating_sub(self.held())
            .saturating_sub(self.wanted.load(Ordering::Relaxed))
            .max(self.budget / FLOOR_DIVISOR)
    }

    fn usable(&self) -> u64 {
        self.budget - self.budget / MARGIN_DIVISOR
    }

    /// Registers what frees the read cache's memory when a hold does not fit (once).
    pub fn set_reclaimer(&self, reclaim: Reclaimer) {
        let _ = self.reclaimer.0.set(reclaim);
    }

    /// Holds `n` bytes for work other than an operator if they fit now beside
    /// everything else, or within the [`HOLD_FLOOR_DIVISOR`] floor, or if nothing
    /// else is held (one at a time, whatever the rest of the process holds: a node
    /// in a process that holds more than its budget besides still serves reads);
    /// false (nothing held) if not. Give them back with [`release`](Self::release).
    pub fn try_hold(&self, n: u64) -> bool {
        let room = self
            .usable()
            .saturating_sub(self.outside())
            .saturating_sub(self.pooled());
        let floor = self.budget / HOLD_FLOOR_DIVISOR;
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                let total = held.checked_add(n)?;
                (total <= room || total <= floor || held == 0).then_some(total)
            })
            .is_ok()
    }

    /// Gives back `n` held bytes and wakes holds waiting for memory.
    pub fn release(&self, n: u64) {
        let _ = self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                Some(held.saturating_sub(n))
            });
        self.freed.notify_waiters();
    }

    /// Holds `n` bytes for `what` (an upload, a scan: for the error), waiting up to
    /// `patience` for them: the read cache is asked to let go first, then the hold
    /// waits for others to give memory back. Refused at once if `n` exceeds what the
    /// budget leaves anyone, with `RESOURCE_EXHAUSTED` and a retry hint after its
    /// patience.
    pub async fn hold(self: &Arc<Self>, n: u64, what: &str, patience: Duration) -> Result<Held> {
        if n > self.usable() {
            return Err(Error::ResourcesExhausted(format!(
                "{what} needs {} of memory, more than this node's whole budget leaves ({} of --memory {})",
                ByteSize(n),
                ByteSize(self.usable()),
                ByteSize(self.budget)
            )));
        }
        let deadline = tokio::time::Instant::now() + patience;
        let mut reclaimed = false;
        let mut waiting: Option<Wanted<'_>> = None;
        loop {
            let freed = self.freed.notified();
            if self.try_hold(n) {
                return Ok(Held {
                    ledger: self.clone(),
                    n,
                });
            }
            if !reclaimed {
                reclaimed = true;
                if let Some(r) = self.reclaimer.0.get()
                    && r() > 0
                {
                    continue;
                }
            }
            // While it waits, operators do not grow into what it waits for.
            waiting.get_or_insert_with(|| Wanted::new(&self.wanted, n));
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Err(Error::Busy {
                    reason: format!(
                        "{what} needs {} of memory and the node's budget (--memory {}) has been in use for {:.1} s: operators hold {}, uploads, reads and the read cache {}, the rest of the process {}",
                        ByteSize(n),
                        ByteSize(self.budget),
                        patience.as_secs_f64(),
                        ByteSize(self.pooled()),
                        ByteSize(self.held()),
                        ByteSize(self.outside())
                    ),
                    retry_after: Duration::from_secs(1),
                });
            }
            let _ = tokio::time::timeout(HOLD_POLL.min(deadline - now), freed).await;
        }
    }

    /// Takes `n` bytes for an operator's pool if they fit under
    /// [`operator_limit`](Self::operator_limit); false (nothing taken) if not.
    pub fn try_take(&self, n: u64) -> bool {
        let limit = self.operator_limit();
        self.pooled
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(n).filter(|&total| total <= limit)
            })
            .is_ok()
    }

    /// Takes `n` bytes if they fit, after returning the allocator's free memory to
    /// the OS once if they do not: a finished query's freed buffers stay resident in
    /// glibc's arenas and count against operators until then (a sort refused after a
    /// large aggregate had finished). At most one trim per [`TRIM_EVERY`]; blocking
    /// for a few milliseconds when it trims.
    pub fn try_take_or_trim(&self, n: u64) -> bool {
        if self.try_take(n) {
            return true;
        }
        let now = self.epoch.elapsed().as_micros() as u64 + 1;
        let last = self.trimmed_us.load(Ordering::Relaxed);
        let due = last == 0 || now.saturating_sub(last) >= TRIM_EVERY.as_micros() as u64;
        if !due
            || self
                .trimmed_us
                .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
        {
            return false;
        }
        trim();
        // What the window's peak counted was freed: sample afresh.
        let outside = (self.resident)()
            .unwrap_or(0)
            .saturating_sub(self.pooled())
            .saturating_sub(self.held());
        self.outside.store(outside, Ordering::Relaxed);
        self.window_us.store(now, Ordering::Relaxed);
        self.sampled_us.store(now, Ordering::Relaxed);
        self.try_take(n)
    }

    /// Takes `n` bytes whether or not they fit (memory already allocated).
    pub fn take(&self, n: u64) {
        self.pooled.fetch_add(n, Ordering::AcqRel);
    }

    /// Gives back `n` bytes taken earlier.
    pub fn give_back(&self, n: u64) {
        // Never below zero, whatever a caller's arithmetic.
        let _ = self
            .pooled
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                Some(held.saturating_sub(n))
            });
    }
}

/// Bytes a waiting hold adds to [`MemoryLedger`]'s `wanted` until it stops waiting.
struct Wanted<'a> {
    wanted: &'a AtomicU64,
    n: u64,
}

impl<'a> Wanted<'a> {
    fn new(wanted: &'a AtomicU64, n: u64) -> Self {
        wanted.fetch_add(n, Ordering::AcqRel);
        Wanted { wanted, n }
    }
}

impl Drop for Wanted<'_> {
    fn drop(&mut self) {
        self.wanted.fetch_sub(self.n, Ordering::AcqRel);
    }
}

/// Memory held for one piece of work ([`MemoryLedger::hold`]); given back when
/// dropped.
#[derive(Debug)]
pub struct Held {
    ledger: Arc<MemoryLedger>,
    n: u64,
}

impl Held {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.n
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.ledger.release(self.n);
    }
}

/// Returns memory the allocator keeps but nothing uses to the OS (glibc keeps a
/// large upload's freed buffers in its arenas; the node's resident memory, which
/// the budget is held against, would count them until reused). Blocking: a few
/// milliseconds on a large heap.
pub fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the allocator's own arenas.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Resident memory of this process (the second field of `/proc/self/statm`, in
/// pages); `None` where the OS does not say.
pub fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf reads a constant of the running system.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).ok().map(|p| pages * p)
}

/// Peak resident memory of this process (`VmHWM`, in KiB, of `/proc/self/status`).
pub fn peak_resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    static RESIDENT: AtomicU64 = AtomicU64::new(0);

    fn fake() -> Option<u64> {
        Some(RESIDENT.load(Ordering::Relaxed))
    }

    #[test]
    fn operators_get_what_the_rest_of_the_process_leaves() {
        let mib = 1u64 << 20;
        let ledger = MemoryLedger::measuring(256 * mib, fake);
        let resample = || std::thread::sleep(SAMPLE_EVERY * 2);
        // 40 MiB held outside any pool, 32 kept as margin: operators may take 184.
        RESIDENT.store(40 * mib, Ordering::Relaxed);
        assert_eq!(ledger.operator_limit(), 184 * mib);
        assert!(ledger.try_take(170 * mib));
        assert!(!ledger.try_take(15 * mib), "past the limit");
        assert_eq!(ledger.pooled(), 170 * mib);
        // The pools' own bytes are not counted twice once resident.
        RESIDENT.store(210 * mib, Ordering::Relaxed);
        resample();
        assert_eq!(ledger.operator_limit(), 184 * mib);
        assert!(ledger.try_take(14 * mib));
        ledger.give_back(184 * mib);
        assert_eq!(ledger.pooled(), 0);
        ledger.give_back(mib);
        assert_eq!(ledger.pooled(), 0, "never below zero");
        // A crest of memory outside the pools counts for the rest of the window.
        RESIDENT.store(100 * mib, Ordering::Relaxed);
        resample();
        assert_eq!(ledger.operator_limit(), 124 * mib);
        RESIDENT.store(40 * mib, Ordering::Relaxed);
        resample();
        assert_eq!(
            ledger.operator_limit(),
            124 * mib,
            "the trough is not trusted"
        );
        // Unless growth is refused: the allocator is trimmed and the process sampled
        // afresh, once per TRIM_EVERY.
        assert!(!ledger.try_take(150 * mib));
        assert!(ledger.try_take_or_trim(150 * mib), "the crest is gone");
        assert_eq!(ledger.operator_limit(), 184 * mib);
        RESIDENT.store(100 * mib, Ordering::Relaxed);
        resample();
        assert!(
            !ledger.try_take_or_trim(100 * mib),
            "one trim per TRIM_EVERY"
        );
        ledger.give_back(150 * mib);
        RESIDENT.store(40 * mib, Ordering::Relaxed);
        // A process far over its budget outside the pools still leaves the floor.
        RESIDENT.store(900 * mib, Ordering::Relaxed);
        resample();
        assert_eq!(ledger.operator_limit(), 32 * mib);
        assert!(ledger.try_take(32 * mib));
        assert!(!ledger.try_take(1));
        ledger.take(mib);
        assert_eq!(
            ledger.pooled(),
            33 * mib,
            "memory already allocated is counted"
        );
    }

    fn quiet() -> Option<u64> {
        Some(16 << 20)
    }

    #[tokio::test]
    async fn other_work_holds_memory_beside_operators_and_waits_for_it() {
        let mib = 1u64 << 20;
        // 16 MiB resident outside, 32 MiB margin: 208 MiB for pools and holds.
        let ledger = MemoryLedger::measuring(256 * mib, quiet);
        assert!(ledger.try_take(100 * mib));
        let upload = ledger
            .hold(100 * mib, "an upload", Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(ledger.held(), 100 * mib);
        // Operators get what holds leave: 208 - 100.
        assert_eq!(ledger.operator_limit(), 108 * mib);
        assert!(!ledger.try_take(9 * mib));
        ledger.give_back(100 * mib);
        // A second hold that does not fit waits until the first is given back.
        let waiter = tokio::spawn({
            let ledger = ledger.clone();
            async move {
                ledger
                    .hold(150 * mib, "a scan", Duration::from_secs(30))
                    .await
                    .map(|h| h.bytes())
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "it waits");
        // Operators do not grow into what it waits for: 208 - 100 held - 150 wanted.
        assert_eq!(ledger.operator_limit(), 32 * mib);
        drop(upload);
        assert_eq!(waiter.await.unwrap().unwrap(), 150 * mib);
        assert_eq!(ledger.held(), 0, "given back when dropped");
        // Out of patience: RESOURCE_EXHAUSTED with a retry hint, nothing held.
        let _big = ledger
            .hold(200 * mib, "a scan", Duration::ZERO)
            .await
            .unwrap();
        match ledger
            .hold(20 * mib, "an upload", Duration::from_millis(30))
            .await
        {
            Err(Error::Busy {
                reason,
                retry_after,
            }) => {
                assert!(
                    reason.contains("an upload") && reason.contains("--memory"),
                    "{reason}"
                );
                assert!(retry_after > Duration::ZERO);
            }
            other => panic!("expected Busy, got {other:?}"),
        }
        // Holds leave operators their floor: 208 - 200 is less than 32.
        assert_eq!(ledger.operator_limit(), 32 * mib);
        // More than the budget could ever leave: refused at once, not waited for.
        let t = Instant::now();
        let e = ledger
            .hold(300 * mib, "an upload", Duration::from_secs(30))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::ResourcesExhausted(_)), "{e:?}");
        assert!(t.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn the_read_cache_lets_go_before_a_hold_waits() {
        let mib = 1u64 << 20;
        let ledger = MemoryLedger::measuring(256 * mib, quiet);
        // The cache keeps 150 MiB; an upload needs 100.
        assert!(ledger.try_hold(150 * mib));
        let cache = ledger.clone();
        ledger.set_reclaimer(Box::new(move || {
            cache.release(150 * mib);
            150 * mib
        }));
        let h = ledger
            .hold(100 * mib, "an upload", Duration::ZERO)
            .await
            .unwrap();
        assert_eq!((h.bytes(), ledger.held()), (100 * mib, 100 * mib));
    }

    #[test]
    fn this_process_is_measured() {
        let r = resident_bytes().expect("Linux says");
        assert!(r > 1 << 20, "{r}");
        assert!(peak_resident_bytes().expect("Linux says") >= r);
    }
}
