//! The gateway's counters ([`GatewayStats`], `csd stats --gateway`).

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use csd_protocol::GatewayStats;

/// Distinct callers remembered for the `sessions` count (beyond it, every new
/// caller still counts, remembered or not).
const CALLERS_REMEMBERED: usize = 100_000;

#[derive(Debug, Default)]
pub(crate) struct Counters {
    callers: Mutex<HashSet<[u8; 32]>>,
    sessions: AtomicU64,
    pub(crate) handshakes: AtomicU64,
    pub(crate) statements: AtomicU64,
    pub(crate) prepared: AtomicU64,
    pub(crate) queries: AtomicU64,
    pub(crate) queries_failed: AtomicU64,
    pub(crate) queries_cancelled: AtomicU64,
    pub(crate) running: AtomicU64,
    pub(crate) rows_sent: AtomicU64,
    pub(crate) unauthenticated: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Counters {
    /// Counts a caller the first time it is seen.
    pub(crate) fn seen(&self, caller: [u8; 32]) {
        let mut callers = self.callers.lock().unwrap_or_else(|p| p.into_inner());
        if callers.contains(&caller) {
            return;
        }
        if callers.len() < CALLERS_REMEMBERED {
            callers.insert(caller);
        }
        bump(&self.sessions);
    }

    pub(crate) fn snapshot(&self) -> GatewayStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        GatewayStats {
            sessions: get(&self.sessions),
            handshakes: get(&self.handshakes),
            statements: get(&self.statements),
            prepared: get(&self.prepared),
            queries: get(&self.queries),
            queries_failed: get(&self.queries_failed),
            queries_cancelled: get(&self.queries_cancelled),
            running: get(&self.running),
            rows_sent: get(&self.rows_sent),
            unauthenticated: get(&self.unauthenticated),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn callers_count_once() {
        let c = Counters::default();
        c.seen([1; 32]);
        c.seen([1; 32]);
        c.seen([2; 32]);
        bump(&c.queries);
        let s = c.snapshot();
        assert_eq!((s.sessions, s.queries, s.rows_sent), (2, 1, 0));
    }
}
