//! The node's DataFusion memory pool: operators' working memory drawn from the node's
//! [`MemoryLedger`], so that hash tables and sort buffers get what the rest of the
//! process leaves of `--memory` instead of the whole budget.

use std::fmt;
use std::sync::Arc;

use csd_runtime::memory::MemoryLedger;
use datafusion::common::{Result, resources_datafusion_err};
use datafusion::execution::memory_pool::{MemoryLimit, MemoryPool, MemoryReservation};

/// A DataFusion [`MemoryPool`] over the node's ledger.
#[derive(Debug)]
pub(crate) struct LedgerPool {
    ledger: Arc<MemoryLedger>,
}

impl LedgerPool {
    pub(crate) fn new(ledger: Arc<MemoryLedger>) -> Self {
        LedgerPool { ledger }
    }
}

impl fmt::Display for LedgerPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "node memory (operators hold {} of {} bytes they may use now; budget {})",
            self.ledger.pooled(),
            self.ledger.operator_limit(),
            self.ledger.budget()
        )
    }
}

impl MemoryPool for LedgerPool {
    fn name(&self) -> &str {
        "node"
    }

    fn grow(&self, _reservation: &MemoryReservation, additional: usize) {
        self.ledger.take(additional as u64);
    }

    fn shrink(&self, _reservation: &MemoryReservation, shrink: usize) {
        self.ledger.give_back(shrink as u64);
    }

    fn try_grow(&self, reservation: &MemoryReservation, additional: usize) -> Result<()> {
        if self.ledger.try_take_or_trim(additional as u64) {
            return Ok(());
        }
        Err(resources_datafusion_err!(
            "{} asked for {additional} more bytes (it holds {}); {self}",
            reservation.consumer().name(),
            reservation.size()
        ))
    }

    fn reserved(&self) -> usize {
        self.ledger.pooled() as usize
    }

    fn memory_limit(&self) -> MemoryLimit {
        MemoryLimit::Finite(self.ledger.operator_limit() as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::execution::memory_pool::MemoryConsumer;

    #[test]
    fn growth_past_what_the_node_leaves_is_refused_and_shrinking_gives_back() {
        fn resident() -> Option<u64> {
            Some(0)
        }
        let ledger = MemoryLedger::measuring(64 << 20, resident);
        // 64 MiB less the 8 MiB margin.
        let pool: Arc<dyn MemoryPool> = Arc::new(LedgerPool::new(ledger.clone()));
        let r = MemoryConsumer::new("agg").register(&pool);
        r.try_grow(56 << 20).unwrap();
        let e = r.try_grow(1 << 20).unwrap_err().to_string();
        assert!(
            e.contains("agg asked for") && e.contains("budget 67108864"),
            "{e}"
        );
        assert_eq!(ledger.pooled(), 56 << 20);
        r.shrink(20 << 20);
        assert_eq!(pool.reserved(), 36 << 20);
        drop(r);
        assert_eq!(
            ledger.pooled(),
            0,
            "a dropped reservation gives everything back"
        );
    }
}
