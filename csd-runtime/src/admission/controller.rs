//! The decision logic, with time passed in: run now, queue, or hand back each
//! request ([`Controller::offer`]); start queued ones as slots free, fairly
//! ([`Controller::dispatch`]); learn from each that finishes. The roles it draws on
//! live beside it: costs (`costs.rs`), the queueing model (`queueing.rs`), tenants
//! and leases (`tenants.rs`), raw reads (`reads.rs`).

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use super::ask::{Ask, CostKey, Kept, Offer, Reject, Waiting};
use super::config::AdmissionConfig;
use super::costs::{Costs, shape_key};
use super::queueing::{DelayScale, predict};
use super::reads::Reads;
use super::tenants::{LeaseRefused, Tenants};
use csd_protocol::PushBackCause;
use csd_protocol::messages::PushBack;
use csd_protocol::stats::{AdmissionStats, Counters, Policy, TenantStats};

/// What the last [`Controller::offer`] decided beyond its [`Offer`].
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct LastOffer {
    pub(super) estimate: Duration,
    /// The queueing it predicted, scaled (zero if the request ran at once).
    pub(super) predicted: Duration,
    /// Why it queued past the bound, if it did.
    pub(super) kept: Option<Kept>,
}

/// A request holding a slot.
#[derive(Debug)]
struct Running {
    tenant: String,
    operator: CostKey,
    /// Its shape's [`shape_key`], if its operator named a shape.
    shape: Option<u64>,
    bytes: u64,
    memory: u64,
    estimate: Duration,
    started: Duration,
}

/// The decision logic, with time passed in (see the module docs).
#[derive(Debug)]
pub(crate) struct Controller {
    pub(super) cfg: AdmissionConfig,
    next_id: u64,
    running: HashMap<u64, Running>,
    /// Tenants' queues and figures, and what is leased out.
    pub(super) tenants: Tenants,
    /// Learned costs.
    costs: Costs,
    /// Memory reserved by running requests (and taken by [`super::Admission`]).
    pub(super) memory_reserved: u64,
    counters: Counters,
    recent_delays: VecDeque<u32>,
    /// What queueing predictions are multiplied by.
    delay: DelayScale,
    /// What the last offer decided, for [`super::Admission::admit`]'s permit.
    pub(super) last_offer: LastOffer,
    /// Raw reads.
    reads: Reads,
}

impl Controller {
    /// A controller with `cfg`.
    pub(crate) fn new(cfg: AdmissionConfig) -> Self {
        Controller {
            next_id: 1,
            running: HashMap::new(),
            tenants: Tenants::default(),
            costs: Costs::new(&cfg),
            memory_reserved: 0,
            counters: Counters::default(),
            recent_delays: VecDeque::new(),
            delay: DelayScale::new(),
            last_offer: LastOffer::default(),
            reads: Reads::new(),
            cfg,
        }
    }

    /// Slots for admitted work: the workers less those leased out (at least one).
    pub(super) fn slots(&self) -> usize {
        self.cfg.slots.saturating_sub(self.tenants.leased).max(1)
    }

    /// The settings.
    #[cfg(test)]
    pub(super) fn config(&self) -> &AdmissionConfig {
        &self.cfg
    }

    /// The estimated run time of `ask` from the learned cost.
    pub(crate) fn estimate(&self, ask: &Ask) -> Duration {
        self.costs.estimate(ask)
    }

    /// Seconds the asker would take to finish `ask` itself, if its link is known.
    fn cost_at_asker(&self, ask: &Ask) -> Option<f64> {
        let link = ask
            .asker
            .link_bytes_per_s
            .or(self.cfg.link_prior)
            .filter(|l| l.is_finite() && *l > 0.0)?;
        // The asker runs the same engine: this node's learned cost stands for its.
        let per_byte = self.costs.ns_per_byte_of(ask);
        let busy = if ask.asker.load.is_finite() {
            ask.asker.load.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let bytes = ask.bytes as f64;
        let backlog = ask.asker.backlog_bytes as f64;
        Some((backlog + bytes) / link + bytes * per_byte * 1e-9 * (1.0 + busy))
    }

    pub(super) fn memory_fits(&self, memory: u64) -> bool {
        self.memory_reserved + self.tenants.leased_memory + memory <= self.cfg.memory
    }

    /// Slots `tenant` may take now: free slots minus the unmet reserves of others.
    pub(super) fn free_for(&self, tenant: &str) -> usize {
        let free = self.slots().saturating_sub(self.running.len());
        self.tenants.free_for(&self.cfg, tenant, free)
    }

    /// Predicted queueing delay (unscaled) for a new request of `tenant` at `now`.
    pub(crate) fn predicted_delay(&self, tenant: &str, now: Duration) -> Duration {
        let residual: Duration = self
            .running
            .values()
            .map(|r| r.estimate.saturating_sub(now.saturating_sub(r.started)))
            .sum();
        let (queued_all, own, share) = self.tenants.queued_ahead(&self.cfg, tenant);
        predict(residual, queued_all, own, share, self.slots())
    }

    /// Leases `n` slots and `memory` bytes to `tenant` if the node can spare them.
    pub(super) fn lease(
        &mut self,
        tenant: &str,
        n: usize,
        memory: u64,
    ) -> Result<(), LeaseRefused> {
        let (running, reserved) = (self.running.len(), self.memory_reserved);
        self.tenants
            .lease(&self.cfg, tenant, n, memory, running, reserved)
    }

    /// Gives back what [`Self::lease`] took.
    pub(super) fn unlease(&mut self, tenant: &str, n: usize, memory: u64) {
        self.tenants.unlease(tenant, n, memory);
    }

    /// Decides what happens to `ask` at `now`.
    pub(crate) fn offer(&mut self, ask: Ask, now: Duration) -> Offer {
        let estimate = self.estimate(&ask);
        self.last_offer = LastOffer {
            estimate,
            ..LastOffer::default()
        };
        self.costs.touch(&ask);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let push_back = |this: &mut Self, reason: String, delay: Duration| {
            if let Some(reject) = this.reads.saturated(&this.cfg) {
                this.counters.rejected += 1;
                return Offer::Reject(reject);
            }
            this.counters.pushed_back += 1;
            this.tenants
                .states
                .entry(ask.tenant.clone())
                .or_default()
                .pushed_back += 1;
            Offer::PushBack(PushBack {
                reason,
                predicted_delay_ms: ms(delay),
                estimate_ms: ms(estimate),
                bytes: ask.bytes,
                cause: PushBackCause::Admission,
            })
        };
        if self.cfg.policy == Policy::Never {
            return push_back(
                self,
                "this node pushes every operator back (policy never)".into(),
                Duration::ZERO,
            );
        }
        if ask.memory > self.cfg.memory {
            return push_back(
                self,
                format!(
                    "the request needs {} bytes of memory, more than the node's whole budget of {}",
                    ask.memory, self.cfg.memory
                ),
                Duration::ZERO,
            );
        }
        let own_waiting = self
            .tenants
            .states
            .get(&ask.tenant)
            .is_some_and(|t| !t.queue.is_empty());
        if !own_waiting && self.free_for(&ask.tenant) > 0 && self.memory_fits(ask.memory) {
            let id = self.next_id;
            self.next_id += 1;
            self.start(id, ask, estimate, now, Duration::ZERO);
            return Offer::Run(id);
        }
        let raw = self.predicted_delay(&ask.tenant, now);
        let delay = raw.mul_f64(self.delay.scale());
        self.last_offer.predicted = delay;
        let waiting = self.tenants.waiting();
        if waiting >= self.cfg.max_queued {
            return push_back(
                self,
                format!(
                    "the node's queue is full ({waiting} requests wait for {} CPU workers)",
                    self.cfg.slots
                ),
                delay,
            );
        }
        // Waiting up to one run time of its own still beats handing it back (the
        // compute tier would read and decode the same bytes, usually slower).
        // A patient request's asker has no cores to spare: handing it back would only
        // move the queue there, behind that tier's own work.
        let bound = self.cfg.queue_target.max(estimate);
        // Until a request of its kind has finished here, the predicted queueing rests
        // on the prior alone (a server's cost per byte; a drive's weak cores can be
        // hundreds of times slower): at most one more wave of the CPU workers waits,
        // and past it a request is not promised a wait there are no grounds for.
        let cold =
            !self.cfg.trust_prior && !self.costs.learned(&ask.operator) && waiting >= self.slots();
        let over = self.cfg.policy == Policy::Adaptive && (delay > bound || cold);
        let there = self.cost_at_asker(&ask);
        if over && ask.patient {
            self.counters.patient += 1;
            self.last_offer.kept = Some(Kept::Patient);
        } else if over && ask.asker.shares_cores {
            self.counters.kept_shared_cores += 1;
            self.last_offer.kept = Some(Kept::SharedCores);
        } else if over && cold {
            // Nor can it weigh the asker's cost against a wait it cannot predict.
            return push_back(
                self,
                format!(
                    "the node is busy: its {} CPU workers are taken and as many requests wait, \
                     and no {} request has finished here yet to tell how long a longer \
                     wait would be",
                    self.slots(),
                    ask.operator
                ),
                delay,
            );
        } else if over && there.is_some_and(|t| (delay + estimate).as_secs_f64() <= t) {
            self.counters.kept_for_link += 1;
            self.last_offer.kept = Some(Kept::ForLink);
        } else if over {
            return push_back(
                self,
                format!(
                    "the node is busy: predicted queueing {:.1} ms exceeds {:.1} ms (the target, or the request's own run time if longer){}",
                    ms(delay),
                    ms(bound),
                    there
                        .map(|t| format!(
                            ", and finishing it at the compute tier ({:.1} ms over its link and cores) is sooner",
                            t * 1e3
                        ))
                        .unwrap_or_default()
                ),
                delay,
            );
        }
        let id = self.next_id;
        self.next_id += 1;
        let t = self.tenants.activate(&ask.tenant);
        t.queue.push_back(Waiting {
            id,
            ask,
            estimate,
            since: now,
            predicted: raw,
        });
        Offer::Queued(id)
    }

    fn start(&mut self, id: u64, ask: Ask, estimate: Duration, now: Duration, waited: Duration) {
        let share = self.cfg.share(&ask.tenant);
        let vtime = self.tenants.activate(&ask.tenant).vtime;
        self.tenants.vclock = self.tenants.vclock.max(vtime);
        let t = self.tenants.states.entry(ask.tenant.clone()).or_default();
        t.vtime += estimate.as_secs_f64() / share.weight;
        t.running += 1;
        t.admitted += 1;
        self.memory_reserved += ask.memory;
        self.counters.admitted += 1;
        if waited > Duration::ZERO {
            self.counters.queued += 1;
        }
        let us = waited.as_micros() as u64;
        self.counters.queue_delay_us_sum += us;
        self.counters.queue_delay_us_max = self.counters.queue_delay_us_max.max(us);
        if self.recent_delays.len() == 1024 {
            self.recent_delays.pop_front();
        }
        self.recent_delays.push_back(us.min(u32::MAX as u64) as u32);
        self.running.insert(
            id,
            Running {
                tenant: ask.tenant,
                shape: shape_key(&ask.operator, ask.shape),
                operator: ask.operator,
                bytes: ask.bytes,
                memory: ask.memory,
                estimate,
                started: now,
            },
        );
    }

    /// Moves waiting requests into free slots, fairly; returns the ids started, with
    /// how long each waited.
    pub(crate) fn dispatch(&mut self, now: Duration) -> Vec<(u64, Duration)> {
        let mut started = Vec::new();
        loop {
            // The backlogged tenant with the smallest virtual time whose head fits.
            let pick = self
                .tenants
                .states
                .iter()
                .filter(|(name, t)| {
                    t.queue
                        .front()
                        .is_some_and(|w| self.memory_fits(w.ask.memory))
                        && self.free_for(name) > 0
                })
                .min_by(|a, b| a.1.vtime.total_cmp(&b.1.vtime))
                .map(|(n, _)| n.clone());
            let Some(name) = pick else { break };
            let Some(w) = self
                .tenants
                .states
                .get_mut(&name)
                .and_then(|t| t.queue.pop_front())
            else {
                break;
            };
            let waited = now.saturating_sub(w.since);
            self.delay.learn(w.predicted, waited);
            self.start(w.id, w.ask, w.estimate, now, waited);
            started.push((w.id, waited));
        }
        started
    }

    /// A running request `id` ended at `now` after holding its slot for `busy`;
    /// `learn` says whether it ran to completion (only those teach the cost model).
    /// Returns the queued requests that start now.
    pub(crate) fn finish(
        &mut self,
        id: u64,
        now: Duration,
        busy: Duration,
        learn: bool,
    ) -> Vec<(u64, Duration)> {
        if let Some(r) = self.running.remove(&id) {
            self.memory_reserved = self.memory_reserved.saturating_sub(r.memory);
            if let Some(t) = self.tenants.states.get_mut(&r.tenant) {
                t.running = t.running.saturating_sub(1);
            }
            self.counters.busy_us += busy.as_micros() as u64;
            if learn {
                self.costs
                    .learn(&r.operator, r.shape, r.bytes, r.estimate, busy);
            }
        }
        self.dispatch(now)
    }

    /// A queued request `id` whose client went away.
    pub(crate) fn abandon(&mut self, id: u64, now: Duration) -> Vec<(u64, Duration)> {
        for t in self.tenants.states.values_mut() {
            if let Some(i) = t.queue.iter().position(|w| w.id == id) {
                t.queue.remove(i);
                self.counters.abandoned += 1;
                break;
            }
        }
        if self.running.contains_key(&id) {
            return self.finish(id, now, Duration::ZERO, false);
        }
        self.dispatch(now)
    }

    /// A raw read arrives: `Ok(true)` go now, `Ok(false)` wait (call
    /// [`io_dispatch`](Self::io_dispatch) later), or a rejection.
    pub(crate) fn io_offer(&mut self) -> Result<bool, Reject> {
        let offer = self.reads.offer(&self.cfg);
        if offer.is_err() {
            self.counters.rejected += 1;
        }
        offer
    }

    /// A waiting raw read may start if a read slot is free.
    pub(crate) fn io_dispatch(&mut self) -> bool {
        self.reads.dispatch(&self.cfg)
    }

    /// A waiting raw read gave up.
    pub(crate) fn io_abandon(&mut self) {
        self.reads.abandon();
    }

    /// A raw read that took `took` ended.
    pub(crate) fn io_finish(&mut self, took: Duration) {
        self.reads.finish(took);
    }

    /// A snapshot of the figures.
    pub(crate) fn stats(&self) -> AdmissionStats {
        let mut d: Vec<u32> = self.recent_delays.iter().copied().collect();
        d.sort_unstable();
        let pct = |p: f64| -> f64 {
            if d.is_empty() {
                return 0.0;
            }
            let i = ((d.len() as f64 - 1.0) * p).round() as usize;
            d[i.min(d.len() - 1)] as f64 / 1e3
        };
        AdmissionStats {
            policy: self.cfg.policy,
            slots: self.cfg.slots,
            leased: self.tenants.leased,
            lease_memory: self.tenants.leased_memory,
            memory_budget: self.cfg.memory,
            queue_target_ms: self.cfg.queue_target.as_secs_f64() * 1e3,
            running: self.running.len(),
            waiting: self.tenants.waiting(),
            memory_reserved: self.memory_reserved,
            io_in_flight: self.reads.in_flight,
            io_waiting: self.reads.waiting,
            counters: self.counters.clone(),
            queue_delay_p50_ms: pct(0.5),
            queue_delay_p99_ms: pct(0.99),
            queue_prediction_scale: self.delay.scale(),
            costs: self.costs.operators(),
            cost_shapes: self.costs.shapes(),
            tenants: self
                .tenants
                .states
                .iter()
                .map(|(n, t)| {
                    (
                        n.clone(),
                        TenantStats {
                            admitted: t.admitted,
                            pushed_back: t.pushed_back,
                            running: t.running,
                            waiting: t.queue.len(),
                        },
                    )
                })
                .collect(),
        }
    }
}
