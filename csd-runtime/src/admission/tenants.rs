//! Tenants: start-time fair queuing over them (a tenant's virtual time advances by
//! `cost / weight` per dispatch; one coming back from idle starts at the current
//! virtual time, so idleness earns no burst), the slots held back for reserves
//! (a tenant's `reserve` slots are kept from the others while it has work), and
//! leased slots and memory (which count toward their tenant's reserve).

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use super::ask::Waiting;
use super::config::AdmissionConfig;

/// One tenant's queue and figures.
#[derive(Debug, Default)]
pub(super) struct TenantState {
    pub(super) vtime: f64,
    pub(super) running: usize,
    pub(super) queue: VecDeque<Waiting>,
    pub(super) admitted: u64,
    pub(super) pushed_back: u64,
}

/// All tenants, and the slots and memory leased out.
#[derive(Debug, Default)]
pub(super) struct Tenants {
    pub(super) states: BTreeMap<String, TenantState>,
    /// The virtual time: the largest a dispatched tenant had.
    pub(super) vclock: f64,
    /// Slots leased out: admitted work sees fewer.
    pub(super) leased: usize,
    /// Of those, by tenant (they count toward its reserve).
    pub(super) leased_by: BTreeMap<String, usize>,
    /// Memory leases hold for their own requests: admitted work sees less.
    pub(super) leased_memory: u64,
}

impl Tenants {
    /// Slots `tenant` holds: running requests and leased slots.
    fn held_by(&self, tenant: &str, running: usize) -> usize {
        running + self.leased_by.get(tenant).copied().unwrap_or(0)
    }

    /// Slots `tenant` may take of the `free` ones: all of them while it is under its
    /// reserve, else those beyond the unmet reserves of the others that wait.
    pub(super) fn free_for(&self, cfg: &AdmissionConfig, tenant: &str, free: usize) -> usize {
        let own = self.held_by(
            tenant,
            self.states.get(tenant).map(|t| t.running).unwrap_or(0),
        );
        if own < cfg.share(tenant).reserve {
            return free;
        }
        let held: usize = self
            .states
            .iter()
            .filter(|(name, t)| name.as_str() != tenant && !t.queue.is_empty())
            .map(|(name, t)| {
                cfg.share(name)
                    .reserve
                    .saturating_sub(self.held_by(name, t.running))
            })
            .sum();
        free.saturating_sub(held)
    }

    /// `tenant`'s state; one coming back from idle starts at the current virtual
    /// time, so idleness earns no burst.
    pub(super) fn activate(&mut self, tenant: &str) -> &mut TenantState {
        let vclock = self.vclock;
        let t = self.states.entry(tenant.to_string()).or_default();
        if t.queue.is_empty() && t.running == 0 {
            t.vtime = t.vtime.max(vclock);
        }
        t
    }

    /// Requests waiting, all tenants.
    pub(super) fn waiting(&self) -> usize {
        self.states.values().map(|t| t.queue.len()).sum()
    }

    /// What waits ahead of a new request of `tenant`: the work queued by all
    /// tenants, by `tenant`, and `tenant`'s share of the slots among the busy ones.
    pub(super) fn queued_ahead(
        &self,
        cfg: &AdmissionConfig,
        tenant: &str,
    ) -> (Duration, Duration, f64) {
        let queued_all: Duration = self
            .states
            .values()
            .flat_map(|t| t.queue.iter().map(|w| w.estimate))
            .sum();
        let own: Duration = self
            .states
            .get(tenant)
            .map(|t| t.queue.iter().map(|w| w.estimate).sum())
            .unwrap_or_default();
        let w = cfg.share(tenant).weight;
        let others: f64 = self
            .states
            .iter()
            .filter(|(n, t)| n.as_str() != tenant && (!t.queue.is_empty() || t.running > 0))
            .map(|(n, _)| cfg.share(n).weight)
            .sum();
        (queued_all, own, w / (w + others))
    }

    /// Leases `n` slots and `memory` bytes to `tenant` if the node can spare them
    /// now: beyond the `running` requests and the `reserved` memory, leaving at
    /// least one slot and the other tenants' reserves to everyone else (a tenant
    /// may lease its own).
    pub(super) fn lease(
        &mut self,
        cfg: &AdmissionConfig,
        tenant: &str,
        n: usize,
        memory: u64,
        running: usize,
        reserved: u64,
    ) -> Result<(), LeaseRefused> {
        let reserves: usize = cfg
            .tenants
            .iter()
            .filter(|(name, _)| name.as_str() != tenant)
            .map(|(_, t)| t.reserve)
            .sum();
        let keep = reserves.max(1);
        let idle = cfg.slots.saturating_sub(self.leased + running);
        if n == 0 {
            return Err(LeaseRefused::NoSlots);
        }
        if cfg.slots < self.leased + n + keep {
            return Err(LeaseRefused::KeptForOthers {
                slots: cfg.slots,
                leased: self.leased,
                keep,
                asked: n,
            });
        }
        if n > idle {
            return Err(LeaseRefused::Busy {
                idle,
                slots: cfg.slots,
                running,
                leased: self.leased,
            });
        }
        if memory > 0 && reserved + self.leased_memory + memory > cfg.memory {
            return Err(LeaseRefused::Memory {
                asked: memory,
                held: reserved + self.leased_memory,
                budget: cfg.memory,
            });
        }
        self.leased += n;
        *self.leased_by.entry(tenant.to_string()).or_default() += n;
        self.leased_memory += memory;
        Ok(())
    }

    /// Gives back what [`Self::lease`] took.
    pub(super) fn unlease(&mut self, tenant: &str, n: usize, memory: u64) {
        self.leased = self.leased.saturating_sub(n);
        if let Some(l) = self.leased_by.get_mut(tenant) {
            *l = l.saturating_sub(n);
            if *l == 0 {
                self.leased_by.remove(tenant);
            }
        }
        self.leased_memory = self.leased_memory.saturating_sub(memory);
    }
}

/// Why a lease was refused (the node cannot spare what it asks now).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseRefused {
    /// It asked for no slot.
    NoSlots,
    /// Granting it would leave too few slots for other work.
    KeptForOthers {
        /// The node's CPU workers.
        slots: usize,
        /// Slots leased already.
        leased: usize,
        /// Slots kept for other work: the other tenants' reserves, at least one.
        keep: usize,
        /// Slots asked.
        asked: usize,
    },
    /// Too few slots are idle now.
    Busy {
        /// Idle slots.
        idle: usize,
        /// The node's CPU workers.
        slots: usize,
        /// Requests running.
        running: usize,
        /// Slots leased already.
        leased: usize,
    },
    /// The memory it asks is not free now.
    Memory {
        /// Bytes asked.
        asked: u64,
        /// Bytes held by running requests and leases.
        held: u64,
        /// The node's budget.
        budget: u64,
    },
}

impl std::fmt::Display for LeaseRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LeaseRefused::NoSlots => f.write_str("a lease needs at least one slot"),
            LeaseRefused::KeptForOthers {
                slots,
                leased,
                keep,
                asked,
            } => write!(
                f,
                "the node has {slots} CPU workers, {leased} leased and {keep} kept for other work (the other tenants' reserves, at least one): {asked} more cannot be leased"
            ),
            LeaseRefused::Busy {
                idle,
                slots,
                running,
                leased,
            } => write!(
                f,
                "only {idle} of the node's {slots} CPU workers are idle now ({running} run requests, {leased} are leased)"
            ),
            LeaseRefused::Memory {
                asked,
                held,
                budget,
            } => write!(
                f,
                "{asked} bytes of memory are not free now ({held} of {budget} held by running requests and leases)"
            ),
        }
    }
}
