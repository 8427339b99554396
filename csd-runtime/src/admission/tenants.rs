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
    ) -> Result<(), String> {
        let reserves: usize = cfg
            .tenants
            .iter()
            .filter(|(name, _)| name.as_str() != tenant)
            .map(|(_, t)| t.reserve)
            .sum();
        let keep = reserves.max(1);
        let idle = cfg.slots.saturating_sub(self.leased + running);
        if n == 0 {
            return Err("a lease needs at least one slot".into());
        }
        if cfg.slots < self.leased + n + keep {
            return Err(format!(
                "the node has {} CPU workers, {} leased and {keep} kept for other work (the other tenants' reserves, at least one): {n} more cannot be leased",
                cfg.slots, self.leased
            ));
        }
        if n > idle {
            return Err(format!(
                "only {idle} of the node's {} CPU workers are idle now ({running} run requests, {} are leased)",
                cfg.slots, self.leased
            ));
        }
        if memory > 0 && reserved + self.leased_memory + memory > cfg.memory {
            return Err(format!(
                "{memory} bytes of memory are not free now ({} of {} held by running requests and leases)",
                reserved + self.leased_memory,
                cfg.memory
            ));
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
