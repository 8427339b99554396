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

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How stale the resident-memory sample may be.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(5);

/// The memory outside the pools counts at its highest over this window: it swings
/// with each row group decoded and batch sent, and a pool sized at a trough would
/// overrun the budget at the next crest.
pub const PEAK_WINDOW: Duration = Duration::from_secs(2);

/// Operators may always take this share of the budget, whatever else the process
/// holds (1/8): enough for any operator to make progress, so that a node over its
/// budget for reasons operators cannot change slows down instead of failing queries.
pub const FLOOR_DIVISOR: u64 = 8;

/// What operators leave unused of the budget (1/8), for the memory outside the
/// pools to grow into between samples (the next row group's pages, a batch being
/// encoded).
pub const MARGIN_DIVISOR: u64 = 8;

/// The node-wide account of operator memory against the budget.
#[derive(Debug)]
pub struct MemoryLedger {
    budget: u64,
    /// Bytes operators' pools hold now.
    pooled: AtomicU64,
    /// Highest bytes the process held outside the pools in the current window.
    outside: AtomicU64,
    /// When the current window began (microseconds since `epoch`).
    window_us: AtomicU64,
    /// When that sample was taken, in microseconds since `epoch` (+1; 0: never).
    sampled_us: AtomicU64,
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
            outside: AtomicU64::new(0),
            window_us: AtomicU64::new(0),
            sampled_us: AtomicU64::new(0),
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

    /// Bytes the process holds outside operators' pools: the highest sample of the
    /// last [`PEAK_WINDOW`] or two (0 where the OS does not say).
    pub fn outside(&self) -> u64 {
        let now = self.epoch.elapsed().as_micros() as u64 + 1;
        let last = self.sampled_us.load(Ordering::Relaxed);
        if last == 0 || now.saturating_sub(last) >= SAMPLE_EVERY.as_micros() as u64 {
            // Several threads may sample at once; any of their samples will do.
            self.sampled_us.store(now, Ordering::Relaxed);
            let outside = (self.resident)().unwrap_or(0).saturating_sub(self.pooled());
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
    /// holds besides and a [`MARGIN_DIVISOR`]th margin, and never less than a
    /// [`FLOOR_DIVISOR`]th of the budget.
    pub fn operator_limit(&self) -> u64 {
        (self.budget - self.budget / MARGIN_DIVISOR)
            .saturating_sub(self.outside())
            .max(self.budget / FLOOR_DIVISOR)
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

    #[test]
    fn this_process_is_measured() {
        let r = resident_bytes().expect("Linux says");
        assert!(r > 1 << 20, "{r}");
        assert!(peak_resident_bytes().expect("Linux says") >= r);
    }
}
