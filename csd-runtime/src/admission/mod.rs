//! Admission control: run now, queue (bounded by a queueing-delay target), or push
//! back to the compute tier; reject only when even raw reads cannot be served.
//!
//! # The decision
//! Every operator request arrives with an [`Ask`]: the bytes it will read (the
//! operator's estimate after pruning) and the memory it needs. Its cost is
//! `overhead + bytes × ns_per_byte`, where `ns_per_byte` is learned online per
//! operator from the requests this node has finished (an exponentially weighted
//! mean; no pre-profiling, no per-query table). Within an operator, requests of a
//! repeated shape (the [`shape`](crate::operator::Estimate::shape) its operator estimates:
//! the same plan over another partition, or again) learn their own per-byte cost,
//! which replaces the operator's once one has finished: one SQL fragment may cost
//! ten times another per byte, and a mean over both mispredicts each. The shapes
//! kept are bounded (the least recently seen are forgotten). The controller then
//! predicts the queueing delay the request would see:
//!
//! ```text
//! delay = (residual work of running requests
//!          + min(all queued work, this tenant's queued work / its share)) / slots
//! ```
//!
//! scaled by how far such predictions have been off lately (the 90th percentile of
//! actual over predicted queueing of the last 256 queued requests, between 0.5 and
//! 4: estimates err, running requests overrun theirs, raw reads share the cores;
//! the node measures the sum rather than model each),
//! and decides: **run** if a slot and the memory are free for its tenant and nothing
//! of that tenant waits; **queue** if the predicted delay is within the target (or
//! within the request's own estimated run time, if that is longer: waiting one run
//! time at the node still beats the compute tier reading and decoding the bytes);
//! otherwise **push back**: the node answers before doing any work, and the compute
//! tier reads the byte ranges and evaluates the fragment itself. A request whose
//! memory can never fit is pushed back at once.
//!
//! # Pricing the link
//! Handing work back is not free for the asker: it must pull the fragment's raw
//! bytes over its link and decode them with its own cores. When the link's
//! throughput is known ([`Asker`]: measured by the asker and sent with the request,
//! or learned by the node from the raw reads that peer made, see [`crate::link`],
//! or else the configured prior, `csd serve --link-prior-mbit`, 1 Gbit/s by default),
//! a request the rule above would push back is kept queued when finishing it here
//! is predicted to be sooner:
//!
//! ```text
//! here  = delay + estimate
//! there = (backlog + bytes) / link + bytes × ns_per_byte × (1 + asker load)
//! ```
//!
//! `backlog` is what this node handed back to the same peer that its link has not
//! carried yet at its throughput: with several clients behind one link, work handed
//! back to each queues on that link.
//!
//! The asker evaluates handed-back fragments one per core, oldest first, each at
//! full speed once it starts; its load counts the busy and waiting fragments per
//! core (at most 1: a busier asker sends its requests patient), so a fragment handed
//! back waits about one fragment's time per unit of load, then runs.
//! (`ns_per_byte` is this node's learned cost: the asker runs the same engine.) The answer's own bytes cross the link either way, less
//! of them from here, so they are left out, which only favours handing back. On a
//! fast link `there` is about the request's run time, the rule above.
//!
//! An asker on this node's host whose cores are all the node's too (the same kernel
//! boot, its CPUs within the node's, and as many node workers as the node may use
//! cores; see [`csd_protocol::host`]) gains nothing from work handed back: it would decode the bytes on the cores the node is busy with,
//! behind the same queue. Such a request is queued past the bound as a patient one
//! is (`kept_shared_cores`). The asker's load is its host's busy fraction when that
//! is higher than its own queue's, so a host busy with other work prices handing
//! back higher too.
//!
//! A slot is one CPU worker: operators plan with one partition per request, so a
//! request's time holding its slot is its CPU time (plus I/O waits, which io_uring
//! keeps short); that held time is what the cost model learns from.
//!
//! # Fairness
//! Queued requests are dispatched by start-time fair queuing over tenants (a
//! tenant's virtual time advances by `cost / weight` per dispatch; a tenant coming
//! back from idle starts at the current virtual time, so idleness earns no burst).
//! A tenant's `reserve` slots are held back from the others while it has work.
//!
//! # Raw reads
//! Range reads (the pushed-back fallback and the no-pushdown path) are cheap in CPU
//! but still bounded: `io_in_flight` at once, `io_queue` waiting. Beyond that the
//! node answers `RESOURCE_EXHAUSTED` with a retry-after hint, which
//! [`NodeClient`](crate::node_client::NodeClient) honours. An operator request that
//! would be pushed back while raw reads are saturated is rejected the same way.
//!
//! `Controller` holds the logic and takes the time as an argument, so tests drive
//! it with a controllable clock; [`Admission`] wraps it for the service.

mod ask;
mod config;
mod controller;
mod costs;
mod permit;
mod queueing;
mod reads;
mod tenants;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

pub use ask::{Ask, Asker, CostKey, Kept, Offer, Reject};
pub(crate) use config::parse_tenant;
pub use config::{AdmissionConfig, DEFAULT_TENANT, TenantShare};
pub(crate) use controller::Controller;
use controller::LastOffer;
pub use csd_protocol::messages::PushBack;
pub use csd_protocol::stats::{AdmissionStats, CostModel, Counters, Policy, TenantStats};
use permit::QueueGuard;
pub use permit::{Permit, ReadPermit};
pub use tenants::LeaseRefused;

/// The service's admission control: a `Controller` on the real clock, with
/// queued requests woken when a slot frees.
#[derive(Debug)]
pub struct Admission {
    ctl: Mutex<Controller>,
    waiters: Mutex<HashMap<u64, oneshot::Sender<Duration>>>,
    io_waiters: Mutex<VecDeque<oneshot::Sender<()>>>,
    epoch: Instant,
}

/// Why an operator request does not run here.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    /// The compute tier should evaluate it.
    PushBack(PushBack),
    /// Retry later.
    Reject(Reject),
}

impl Admission {
    /// Admission control with `cfg`.
    pub fn new(cfg: AdmissionConfig) -> Arc<Self> {
        Arc::new(Admission {
            ctl: Mutex::new(Controller::new(cfg)),
            waiters: Mutex::new(HashMap::new()),
            io_waiters: Mutex::new(VecDeque::new()),
            epoch: Instant::now(),
        })
    }

    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    fn ctl(&self) -> std::sync::MutexGuard<'_, Controller> {
        // A panic while holding the lock leaves consistent-enough counters; go on.
        self.ctl.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A snapshot of the figures.
    pub fn stats(&self) -> AdmissionStats {
        self.ctl().stats()
    }

    /// Leases `n` slots and `memory` bytes to `tenant` (see `Controller::lease`):
    /// they are taken from what admitted work may use until [`Self::unlease`].
    /// Refused, with why, when the node cannot spare them now.
    pub fn lease(&self, tenant: &str, n: usize, memory: u64) -> Result<(), LeaseRefused> {
        self.ctl().lease(tenant, n, memory)
    }

    /// Gives back what [`Self::lease`] took; queued work may start on it.
    pub fn unlease(&self, tenant: &str, n: usize, memory: u64) {
        let started = {
            let mut ctl = self.ctl();
            ctl.unlease(tenant, n, memory);
            let now = self.now();
            ctl.dispatch(now)
        };
        self.wake(started);
    }

    /// Holds `memory` bytes of the node's budget for a request that runs on a lease
    /// without memory of its own, if they are free now (`false`: not held).
    pub fn take_memory(&self, memory: u64) -> bool {
        let mut ctl = self.ctl();
        let fits = ctl.memory_fits(memory);
        if fits {
            ctl.memory_reserved += memory;
        }
        fits
    }

    /// Gives back what [`Self::take_memory`] held.
    pub fn give_memory(&self, memory: u64) {
        let started = {
            let mut ctl = self.ctl();
            ctl.memory_reserved = ctl.memory_reserved.saturating_sub(memory);
            let now = self.now();
            ctl.dispatch(now)
        };
        self.wake(started);
    }

    /// Replaces the tenants' shares (a reloaded tenants file); refused, keeping the
    /// old ones, when their reserves exceed the slots.
    pub fn set_tenants(&self, tenants: BTreeMap<String, TenantShare>) -> csd_protocol::Result<()> {
        let mut ctl = self.ctl();
        let reserved: usize = tenants.values().map(|t| t.reserve).sum();
        if reserved > ctl.cfg.slots {
            return Err(csd_protocol::Error::InvalidArgument(format!(
                "tenants reserve {reserved} slots but the node has {} CPU workers",
                ctl.cfg.slots
            )));
        }
        ctl.cfg.tenants = tenants;
        Ok(())
    }

    /// The tenant whose share a request named `tenant` draws on: a tenant the node
    /// was configured with, or else the shared [`DEFAULT_TENANT`] bucket, so that
    /// names a client makes up create no state of their own.
    pub fn bucket(&self, tenant: &str) -> String {
        if self.ctl().cfg.tenants.contains_key(tenant) {
            tenant.to_string()
        } else {
            DEFAULT_TENANT.to_string()
        }
    }

    fn wake(&self, started: Vec<(u64, Duration)>) {
        let mut pending = started;
        while !pending.is_empty() {
            let mut next = Vec::new();
            for (id, waited) in pending {
                let tx = self
                    .waiters
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&id);
                let delivered = tx.is_some_and(|tx| tx.send(waited).is_ok());
                if !delivered {
                    // Its client went away between dispatch and wake-up.
                    next.extend(self.ctl().finish(id, self.now(), Duration::ZERO, false));
                }
            }
            pending = next;
        }
    }

    /// Waits for a slot (if queued) and returns the permit, or the refusal.
    pub async fn admit(self: &Arc<Self>, ask: Ask) -> Result<Permit, Refusal> {
        let (offer, rx, last) = {
            let mut ctl = self.ctl();
            let offer = ctl.offer(ask, self.now());
            let last = ctl.last_offer;
            let rx = match offer {
                Offer::Queued(id) => {
                    let (tx, rx) = oneshot::channel();
                    self.waiters
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(id, tx);
                    Some(rx)
                }
                _ => None,
            };
            (offer, rx, last)
        };
        match offer {
            Offer::Run(id) => Ok(self.permit(id, last, Duration::ZERO)),
            Offer::Queued(id) => {
                let mut guard = QueueGuard {
                    adm: self.clone(),
                    id,
                    armed: true,
                };
                let waited = match rx {
                    Some(rx) => rx.await.unwrap_or_default(),
                    None => Duration::ZERO,
                };
                guard.armed = false;
                Ok(self.permit(id, last, waited))
            }
            Offer::PushBack(p) => Err(Refusal::PushBack(p)),
            Offer::Reject(r) => Err(Refusal::Reject(r)),
        }
    }

    fn permit(self: &Arc<Self>, id: u64, offer: LastOffer, waited: Duration) -> Permit {
        Permit {
            adm: self.clone(),
            id,
            started: Instant::now(),
            estimate: offer.estimate,
            predicted: offer.predicted,
            waited,
            kept: offer.kept,
            completed: false,
        }
    }

    /// Why a request that queued `waited` (predicted to run `estimate`) waited longer
    /// than the queueing target, in words for its report; `None` within the target.
    pub fn why_waited(
        &self,
        waited: Duration,
        estimate: Duration,
        kept: Option<Kept>,
    ) -> Option<String> {
        if waited.is_zero() {
            return None;
        }
        let (policy, target) = {
            let ctl = self.ctl();
            (ctl.cfg.policy, ctl.cfg.queue_target)
        };
        if waited <= target {
            return None;
        }
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        Some(if kept == Some(Kept::Patient) {
            "the compute tier was saturated and asked the node to queue it rather than hand it back"
                .into()
        } else if kept == Some(Kept::SharedCores) {
            "predicted queueing exceeded the bound, but the compute tier runs on this node's own cores: handed back, it would run there behind the same work"
                .into()
        } else if kept == Some(Kept::ForLink) {
            "predicted queueing exceeded the bound, but finishing it at the compute tier (the raw bytes over its link, its busy cores) was priced slower"
                .into()
        } else if policy == Policy::Always {
            "policy always: the node queues every request rather than hand it back".into()
        } else if waited <= estimate.mul_f64(2.0) {
            format!(
                "queueing was predicted within the request's own run time ({:.1} ms): waiting still beats reading and decoding it on the compute tier",
                ms(estimate)
            )
        } else {
            format!(
                "the node's prediction was wrong: requests ahead ran longer than their estimates (this one: {:.1} ms); the cost model learns from each",
                ms(estimate)
            )
        })
    }

    /// Waits for a raw-read slot, or the rejection.
    pub async fn read(self: &Arc<Self>) -> Result<ReadPermit, Reject> {
        let go = self.ctl().io_offer()?;
        if !go {
            let (tx, rx) = oneshot::channel();
            self.io_waiters
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push_back(tx);
            if rx.await.is_err() {
                // Never happens while the node lives: every sender is woken or kept.
                self.ctl().io_abandon();
            }
        }
        Ok(ReadPermit {
            adm: self.clone(),
            started: Instant::now(),
        })
    }

    fn io_release(&self, took: Duration) {
        let mut ctl = self.ctl();
        ctl.io_finish(took);
        while ctl.io_dispatch() {
            let tx = self
                .io_waiters
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop_front();
            match tx {
                Some(tx) => {
                    if tx.send(()).is_err() {
                        // That reader gave up: its slot goes to the next one.
                        ctl.io_finish(Duration::ZERO);
                    }
                }
                None => {
                    ctl.io_finish(Duration::ZERO);
                    break;
                }
            }
        }
    }
}

impl permit::Release for Admission {
    fn abandon(&self, id: u64) {
        self.waiters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
        let now = self.now();
        let started = self.ctl().abandon(id, now);
        self.wake(started);
    }

    fn finish(&self, id: u64, busy: Duration, completed: bool) {
        let now = self.now();
        let started = self.ctl().finish(id, now, busy, completed);
        self.wake(started);
    }

    fn read_done(&self, busy: Duration) {
        self.io_release(busy);
    }
}
