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
//! (`ns_per_byte` is the asker's own figure if it sent one, else this node's learned
//! cost: the same engine.) The answer's own bytes cross the link either way, less
//! of them from here, so they are left out, which only favours handing back. On a
//! fast link `there` is about the request's run time, the rule above.
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

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

/// Which requests the node runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Run, queue or push back by predicted delay and memory (the default).
    #[default]
    Adaptive,
    /// Run everything pushed down, queueing without a delay bound (up to
    /// `max_queued`); memory that can never fit is still pushed back.
    Always,
    /// Push every operator request back (the node serves raw reads only).
    Never,
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "adaptive" => Ok(Policy::Adaptive),
            "always" => Ok(Policy::Always),
            "never" => Ok(Policy::Never),
            _ => Err(format!(
                "unknown admission policy {s:?} (adaptive, always, never)"
            )),
        }
    }
}

/// A tenant's weight and reserved slots.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TenantShare {
    /// Relative share of the CPU slots when several tenants wait.
    pub weight: f64,
    /// Slots held back for this tenant while it has work.
    pub reserve: usize,
}

impl Default for TenantShare {
    fn default() -> Self {
        TenantShare {
            weight: 1.0,
            reserve: 0,
        }
    }
}

/// Parses `name=weight[:reserve]`.
pub(crate) fn parse_tenant(s: &str) -> Result<(String, TenantShare), String> {
    let (name, rest) = s
        .split_once('=')
        .ok_or_else(|| format!("tenant {s:?}: expected name=weight[:reserve]"))?;
    let (w, r) = match rest.split_once(':') {
        Some((w, r)) => (w, Some(r)),
        None => (rest, None),
    };
    let weight: f64 = w
        .parse()
        .ok()
        .filter(|w: &f64| w.is_finite() && *w > 0.0)
        .ok_or_else(|| format!("tenant {name}: weight {w:?} must be a positive number"))?;
    let reserve = match r {
        Some(r) => r
            .parse()
            .map_err(|_| format!("tenant {name}: reserve {r:?} must be a slot count"))?,
        None => 0,
    };
    if name.is_empty() {
        return Err(format!("tenant {s:?}: empty name"));
    }
    Ok((name.to_string(), TenantShare { weight, reserve }))
}

/// The tenant of requests that name none, or one the node does not know.
pub const DEFAULT_TENANT: &str = "default";

/// Admission settings.
#[derive(Debug, Clone)]
pub struct AdmissionConfig {
    /// Requests that run at once (the node's CPU workers).
    pub slots: usize,
    /// Memory the running requests may reserve in all.
    pub memory: u64,
    /// The queueing-delay target: a request predicted to wait longer is pushed back.
    pub(crate) queue_target: Duration,
    /// Requests waiting at most (any policy).
    pub(crate) max_queued: usize,
    /// Which requests run.
    pub policy: Policy,
    /// Cost per byte before anything was learned.
    pub(crate) prior_ns_per_byte: f64,
    /// An asker's link throughput (bytes/s) assumed until one is measured; `None`:
    /// handing back is not priced until then.
    pub link_prior: Option<f64>,
    /// Fixed cost of a request (decode, plan, open).
    pub overhead: Duration,
    /// Weight of a new sample in the learned cost.
    pub(crate) learning_rate: f64,
    /// Named tenants; others get weight 1, no reserve.
    pub tenants: BTreeMap<String, TenantShare>,
    /// Raw reads served at once.
    pub(crate) io_in_flight: usize,
    /// Raw reads waiting at most before `RESOURCE_EXHAUSTED`.
    pub(crate) io_queue: usize,
}

impl AdmissionConfig {
    /// Defaults for a node with `slots` CPU workers and `memory` bytes.
    pub fn new(slots: usize, memory: u64) -> Self {
        AdmissionConfig {
            slots: slots.max(1),
            memory,
            queue_target: Duration::from_millis(50),
            max_queued: 1024,
            policy: Policy::Adaptive,
            prior_ns_per_byte: 2.0,
            link_prior: None,
            overhead: Duration::from_micros(500),
            learning_rate: 0.2,
            tenants: BTreeMap::new(),
            io_in_flight: 64,
            io_queue: 4096,
        }
    }
}

/// What a request asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct Ask {
    /// Operator name (costs are learned per operator).
    pub operator: String,
    /// Tenant.
    pub tenant: String,
    /// Bytes it will read after pruning (the operator's estimate).
    pub bytes: u64,
    /// Memory it needs while running.
    pub memory: u64,
    /// The asker is saturated itself: queue it rather than push it back for delay.
    pub patient: bool,
    /// What handing it back would cost the asker.
    pub asker: Asker,
    /// The request's shape within its operator, if the operator names one (see the
    /// module docs): its per-byte cost is learned apart.
    pub shape: Option<u64>,
}

/// The asker's side of the decision to hand work back (see "Pricing the link").
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Asker {
    /// Throughput of the link between the asker and this node, bytes per second
    /// (`None`: unknown, the link is not priced).
    pub link_bytes_per_s: Option<f64>,
    /// The asker's cost to evaluate a fragment, nanoseconds per raw byte (`None`:
    /// this node's learned cost).
    pub ns_per_byte: Option<f64>,
    /// Fraction of the asker's cores busy, 0 to 1.
    pub load: f64,
    /// Bytes of work this node handed back to the asker's link moments ago that the
    /// link has not carried yet: a fragment handed back now crosses it after them.
    pub backlog_bytes: u64,
}

/// Why a request was pushed back, sent to the client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PushBack {
    /// A sentence for a person.
    pub reason: String,
    /// Predicted queueing delay at the node, in milliseconds.
    pub predicted_delay_ms: f64,
    /// Estimated run time at the node, in milliseconds.
    pub estimate_ms: f64,
    /// Bytes the request would have read at the node (the work handed back).
    #[serde(default)]
    pub bytes: u64,
}

/// The node cannot even serve raw reads now: retry after the hint.
#[derive(Debug, Clone, PartialEq)]
pub struct Reject {
    /// A sentence for a person.
    pub reason: String,
    /// When to retry.
    pub(crate) retry_after: Duration,
}

/// The controller's answer to an offer.
#[derive(Debug, Clone, PartialEq)]
pub enum Offer {
    /// Runs now under this id.
    Run(u64),
    /// Waits under this id until `Controller::finish` dispatches it.
    Queued(u64),
    /// The compute tier should do it.
    PushBack(PushBack),
    /// Not even raw reads can be served.
    Reject(Reject),
}

/// Per-operator learned cost.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CostModel {
    /// Learned nanoseconds per byte read.
    pub ns_per_byte: f64,
    /// Finished requests learned from.
    pub samples: u64,
    /// Mean absolute relative error of the estimates (weighted like the cost).
    pub mean_abs_error: f64,
}

/// A repeated request shape's learned cost.
#[derive(Debug)]
struct ShapeCost {
    ns_per_byte: f64,
    /// When it was last estimated or learned (the controller's tick).
    used: u64,
}

/// Request shapes whose costs are kept at most.
const MAX_SHAPES: usize = 1024;

/// The key a shape's cost is kept under: its operator's cost key and the shape.
fn shape_key(operator: &str, shape: Option<u64>) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let shape = shape?;
    let mut h = std::hash::DefaultHasher::new();
    operator.hash(&mut h);
    shape.hash(&mut h);
    Some(h.finish())
}

/// What the last [`Controller::offer`] decided beyond its [`Offer`].
#[derive(Debug, Clone, Copy, Default)]
struct LastOffer {
    estimate: Duration,
    /// The queueing it predicted, scaled (zero if the request ran at once).
    predicted: Duration,
    /// Queued past the bound because handing it back was priced slower.
    kept_for_link: bool,
}

#[derive(Debug)]
struct Running {
    tenant: String,
    operator: String,
    /// Its shape's [`shape_key`], if its operator named a shape.
    shape: Option<u64>,
    bytes: u64,
    memory: u64,
    estimate: Duration,
    started: Duration,
}

#[derive(Debug)]
struct Waiting {
    id: u64,
    ask: Ask,
    estimate: Duration,
    since: Duration,
    /// The queueing the model predicted for it, unscaled.
    predicted: Duration,
}

/// Queued requests whose prediction error the delay scale is learned from.
const PREDICTION_SAMPLES: usize = 256;
/// Predictions shorter than this are left out of it (wake-up jitter, not the model).
const MIN_PREDICTION: Duration = Duration::from_millis(2);

#[derive(Debug, Default)]
struct TenantState {
    vtime: f64,
    running: usize,
    queue: VecDeque<Waiting>,
    admitted: u64,
    pushed_back: u64,
}

fn one() -> f64 {
    1.0
}

/// Running totals (all requests since start).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Counters {
    /// Operator requests run (at once or after queueing).
    pub admitted: u64,
    /// Of those, the ones that waited in the queue.
    pub queued: u64,
    /// Operator requests pushed back to the compute tier.
    pub pushed_back: u64,
    /// Patient requests queued past the delay bound (their asker was saturated).
    pub patient: u64,
    /// Requests queued past the delay bound because handing them back would cost
    /// their asker more (its link and cores) than waiting here.
    #[serde(default)]
    pub kept_for_link: u64,
    /// Requests refused with RESOURCE_EXHAUSTED.
    pub rejected: u64,
    /// Queued requests whose client went away before they ran.
    pub abandoned: u64,
    /// Sum of queueing delays, microseconds.
    pub queue_delay_us_sum: u64,
    /// Largest queueing delay, microseconds.
    pub queue_delay_us_max: u64,
    /// Slot-microseconds used by finished requests.
    pub busy_us: u64,
}

/// A snapshot for `DoAction stats` and the metrics endpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AdmissionStats {
    /// The policy.
    pub policy: Policy,
    /// Slots (CPU workers).
    pub slots: usize,
    /// Slots leased out now (other work sees fewer).
    #[serde(default)]
    pub leased: usize,
    /// Memory leases hold for the requests run on them.
    #[serde(default)]
    pub lease_memory: u64,
    /// Memory budget.
    pub memory_budget: u64,
    /// Queueing-delay target, milliseconds.
    pub queue_target_ms: f64,
    /// Requests running now.
    pub running: usize,
    /// Requests waiting now.
    pub waiting: usize,
    /// Memory reserved by running requests.
    pub memory_reserved: u64,
    /// Raw reads in flight and waiting.
    pub io_in_flight: usize,
    /// Raw reads waiting.
    pub io_waiting: usize,
    /// Totals.
    pub counters: Counters,
    /// Recent queueing delays of admitted requests (ms): p50 and p99 of the last 1024.
    pub queue_delay_p50_ms: f64,
    /// See `queue_delay_p50_ms`.
    pub queue_delay_p99_ms: f64,
    /// What the node multiplies its queueing predictions by: the 90th percentile of
    /// actual over predicted queueing lately (1 until learned).
    #[serde(default = "one")]
    pub queue_prediction_scale: f64,
    /// Learned costs per operator.
    pub costs: BTreeMap<String, CostModel>,
    /// Request shapes with a cost of their own (see the module docs).
    #[serde(default)]
    pub cost_shapes: usize,
    /// Per tenant: admitted, pushed back, running, waiting.
    pub tenants: BTreeMap<String, TenantStats>,
}

/// One tenant's figures.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TenantStats {
    /// Admitted requests.
    pub admitted: u64,
    /// Pushed-back requests.
    pub pushed_back: u64,
    /// Running now.
    pub running: usize,
    /// Waiting now.
    pub waiting: usize,
}

/// The decision logic, with time passed in (see the module docs).
#[derive(Debug)]
pub(crate) struct Controller {
    cfg: AdmissionConfig,
    next_id: u64,
    running: HashMap<u64, Running>,
    tenants: BTreeMap<String, TenantState>,
    costs: BTreeMap<String, CostModel>,
    /// Per [`shape_key`]: its own learned cost.
    shapes: HashMap<u64, ShapeCost>,
    /// Counts estimates and lessons, to find the least recently used shape.
    tick: u64,
    vclock: f64,
    memory_reserved: u64,
    counters: Counters,
    recent_delays: VecDeque<u32>,
    /// Actual over predicted queueing of recent queued requests.
    prediction_ratios: VecDeque<f32>,
    /// Samples of `prediction_ratios` since start.
    prediction_samples: u64,
    /// What predictions are multiplied by (see the module docs).
    delay_scale: f64,
    /// What the last offer decided, for [`Admission::admit`]'s permit.
    last_offer: LastOffer,
    io_in_flight: usize,
    io_waiting: usize,
    io_service: Duration,
    /// Slots leased out (see [`Admission::lease`]): other work sees fewer.
    leased: usize,
    /// Of those, by tenant (they count toward its reserve).
    leased_by: BTreeMap<String, usize>,
    /// Memory leases hold for their own requests: admitted work sees less.
    leased_memory: u64,
}

impl Controller {
    /// A controller with `cfg`.
    pub(crate) fn new(cfg: AdmissionConfig) -> Self {
        Controller {
            cfg,
            next_id: 1,
            running: HashMap::new(),
            tenants: BTreeMap::new(),
            costs: BTreeMap::new(),
            shapes: HashMap::new(),
            tick: 0,
            vclock: 0.0,
            memory_reserved: 0,
            counters: Counters::default(),
            recent_delays: VecDeque::new(),
            prediction_ratios: VecDeque::new(),
            prediction_samples: 0,
            delay_scale: 1.0,
            last_offer: LastOffer::default(),
            io_in_flight: 0,
            io_waiting: 0,
            io_service: Duration::from_millis(2),
            leased: 0,
            leased_by: BTreeMap::new(),
            leased_memory: 0,
        }
    }

    /// Slots for admitted work: the workers less those leased out (at least one).
    fn slots(&self) -> usize {
        self.cfg.slots.saturating_sub(self.leased).max(1)
    }

    /// Leases `n` slots and `memory` bytes to `tenant` if the node can spare them
    /// now: beyond its current load and memory held, leaving at least one slot and
    /// the other tenants' reserves to everyone else (a tenant may lease its own).
    fn lease(&mut self, tenant: &str, n: usize, memory: u64) -> Result<(), String> {
        let reserves: usize = self
            .cfg
            .tenants
            .iter()
            .filter(|(name, _)| name.as_str() != tenant)
            .map(|(_, t)| t.reserve)
            .sum();
        let keep = reserves.max(1);
        let idle = self
            .cfg
            .slots
            .saturating_sub(self.leased + self.running.len());
        if n == 0 {
            return Err("a lease needs at least one slot".into());
        }
        if self.cfg.slots < self.leased + n + keep {
            return Err(format!(
                "the node has {} CPU workers, {} leased and {keep} kept for other work (the other tenants' reserves, at least one): {n} more cannot be leased",
                self.cfg.slots, self.leased
            ));
        }
        if n > idle {
            return Err(format!(
                "only {idle} of the node's {} CPU workers are idle now ({} run requests, {} are leased)",
                self.cfg.slots,
                self.running.len(),
                self.leased
            ));
        }
        if memory > 0 && !self.memory_fits(memory) {
            return Err(format!(
                "{memory} bytes of memory are not free now ({} of {} held by running requests and leases)",
                self.memory_reserved + self.leased_memory,
                self.cfg.memory
            ));
        }
        self.leased += n;
        *self.leased_by.entry(tenant.to_string()).or_default() += n;
        self.leased_memory += memory;
        Ok(())
    }

    /// Gives back what [`Self::lease`] took.
    fn unlease(&mut self, tenant: &str, n: usize, memory: u64) {
        self.leased = self.leased.saturating_sub(n);
        if let Some(l) = self.leased_by.get_mut(tenant) {
            *l = l.saturating_sub(n);
            if *l == 0 {
                self.leased_by.remove(tenant);
            }
        }
        self.leased_memory = self.leased_memory.saturating_sub(memory);
    }

    /// Slots `tenant` holds: running requests and leased slots.
    fn held_by(&self, tenant: &str, running: usize) -> usize {
        running + self.leased_by.get(tenant).copied().unwrap_or(0)
    }

    /// The settings.
    #[cfg(test)]
    fn config(&self) -> &AdmissionConfig {
        &self.cfg
    }

    fn share(&self, tenant: &str) -> TenantShare {
        self.cfg.tenants.get(tenant).copied().unwrap_or_default()
    }

    /// The learned cost of `operator` per byte read.
    fn ns_per_byte(&self, operator: &str) -> f64 {
        self.costs
            .get(operator)
            .map(|c| c.ns_per_byte)
            .unwrap_or(self.cfg.prior_ns_per_byte)
    }

    /// The learned cost per byte of `ask`: its shape's if one was learned, else its
    /// operator's.
    fn ns_per_byte_of(&self, ask: &Ask) -> f64 {
        shape_key(&ask.operator, ask.shape)
            .and_then(|k| self.shapes.get(&k))
            .map(|c| c.ns_per_byte)
            .unwrap_or_else(|| self.ns_per_byte(&ask.operator))
    }

    /// The estimated run time of `ask` from the learned cost.
    pub(crate) fn estimate(&self, ask: &Ask) -> Duration {
        let per_byte = self.ns_per_byte_of(ask);
        self.cfg.overhead + Duration::from_nanos((ask.bytes as f64 * per_byte).min(1e15) as u64)
    }

    /// Seconds the asker would take to finish `ask` itself, if its link is known.
    fn cost_at_asker(&self, ask: &Ask) -> Option<f64> {
        let link = ask
            .asker
            .link_bytes_per_s
            .or(self.cfg.link_prior)
            .filter(|l| l.is_finite() && *l > 0.0)?;
        let per_byte = ask
            .asker
            .ns_per_byte
            .filter(|n| n.is_finite() && *n >= 0.0)
            .unwrap_or_else(|| self.ns_per_byte_of(ask));
        let busy = if ask.asker.load.is_finite() {
            ask.asker.load.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let bytes = ask.bytes as f64;
        let backlog = ask.asker.backlog_bytes as f64;
        Some((backlog + bytes) / link + bytes * per_byte * 1e-9 * (1.0 + busy))
    }

    /// Slots `tenant` may take now: free slots minus the unmet reserves of others.
    fn free_for(&self, tenant: &str) -> usize {
        let free = self.slots().saturating_sub(self.running.len());
        let own = self.held_by(
            tenant,
            self.tenants.get(tenant).map(|t| t.running).unwrap_or(0),
        );
        if own < self.share(tenant).reserve {
            return free;
        }
        let held: usize = self
            .tenants
            .iter()
            .filter(|(name, t)| name.as_str() != tenant && !t.queue.is_empty())
            .map(|(name, t)| {
                self.share(name)
                    .reserve
                    .saturating_sub(self.held_by(name, t.running))
            })
            .sum();
        free.saturating_sub(held)
    }

    /// Predicted queueing delay for a new request of `tenant` at `now`.
    pub(crate) fn predicted_delay(&self, tenant: &str, now: Duration) -> Duration {
        let residual: Duration = self
            .running
            .values()
            .map(|r| r.estimate.saturating_sub(now.saturating_sub(r.started)))
            .sum();
        let queued_all: Duration = self
            .tenants
            .values()
            .flat_map(|t| t.queue.iter().map(|w| w.estimate))
            .sum();
        let own: Duration = self
            .tenants
            .get(tenant)
            .map(|t| t.queue.iter().map(|w| w.estimate).sum())
            .unwrap_or_default();
        let w = self.share(tenant).weight;
        let others: f64 = self
            .tenants
            .iter()
            .filter(|(n, t)| n.as_str() != tenant && (!t.queue.is_empty() || t.running > 0))
            .map(|(n, _)| self.share(n).weight)
            .sum();
        let share = w / (w + others);
        let ahead = queued_all.min(own.div_f64(share));
        (residual + ahead) / self.slots() as u32
    }

    fn memory_fits(&self, memory: u64) -> bool {
        self.memory_reserved + self.leased_memory + memory <= self.cfg.memory
    }

    /// Decides what happens to `ask` at `now`.
    pub(crate) fn offer(&mut self, ask: Ask, now: Duration) -> Offer {
        let estimate = self.estimate(&ask);
        self.last_offer = LastOffer {
            estimate,
            ..LastOffer::default()
        };
        self.tick += 1;
        if let Some(c) = shape_key(&ask.operator, ask.shape).and_then(|k| self.shapes.get_mut(&k)) {
            c.used = self.tick;
        }
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let push_back = |this: &mut Self, reason: String, delay: Duration| {
            if let Some(reject) = this.io_saturated() {
                this.counters.rejected += 1;
                return Offer::Reject(reject);
            }
            this.counters.pushed_back += 1;
            this.tenants
                .entry(ask.tenant.clone())
                .or_default()
                .pushed_back += 1;
            Offer::PushBack(PushBack {
                reason,
                predicted_delay_ms: ms(delay),
                estimate_ms: ms(estimate),
                bytes: ask.bytes,
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
            .get(&ask.tenant)
            .is_some_and(|t| !t.queue.is_empty());
        if !own_waiting && self.free_for(&ask.tenant) > 0 && self.memory_fits(ask.memory) {
            let id = self.next_id;
            self.next_id += 1;
            self.start(id, ask, estimate, now, Duration::ZERO);
            return Offer::Run(id);
        }
        let raw = self.predicted_delay(&ask.tenant, now);
        let delay = raw.mul_f64(self.delay_scale);
        self.last_offer.predicted = delay;
        let waiting: usize = self.tenants.values().map(|t| t.queue.len()).sum();
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
        let over = self.cfg.policy == Policy::Adaptive && delay > bound;
        let there = self.cost_at_asker(&ask);
        if over && ask.patient {
            self.counters.patient += 1;
        } else if over && there.is_some_and(|t| (delay + estimate).as_secs_f64() <= t) {
            self.counters.kept_for_link += 1;
            self.last_offer.kept_for_link = true;
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
        let t = self.activate(&ask.tenant);
        t.queue.push_back(Waiting {
            id,
            ask,
            estimate,
            since: now,
            predicted: raw,
        });
        Offer::Queued(id)
    }

    /// `tenant`'s state; one coming back from idle starts at the current virtual
    /// time, so idleness earns no burst.
    fn activate(&mut self, tenant: &str) -> &mut TenantState {
        let vclock = self.vclock;
        let t = self.tenants.entry(tenant.to_string()).or_default();
        if t.queue.is_empty() && t.running == 0 {
            t.vtime = t.vtime.max(vclock);
        }
        t
    }

    fn start(&mut self, id: u64, ask: Ask, estimate: Duration, now: Duration, waited: Duration) {
        let share = self.share(&ask.tenant);
        let vtime = self.activate(&ask.tenant).vtime;
        self.vclock = self.vclock.max(vtime);
        let t = self.tenants.entry(ask.tenant.clone()).or_default();
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
                .get_mut(&name)
                .and_then(|t| t.queue.pop_front())
            else {
                break;
            };
            let waited = now.saturating_sub(w.since);
            self.learn_delay(w.predicted, waited);
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
            if let Some(t) = self.tenants.get_mut(&r.tenant) {
                t.running = t.running.saturating_sub(1);
            }
            self.counters.busy_us += busy.as_micros() as u64;
            if learn {
                self.learn(&r.operator, r.bytes, r.estimate, busy);
                self.learn_shape(r.shape, r.bytes, busy);
            }
        }
        self.dispatch(now)
    }

    /// A queued request `id` whose client went away.
    pub(crate) fn abandon(&mut self, id: u64, now: Duration) -> Vec<(u64, Duration)> {
        for t in self.tenants.values_mut() {
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

    fn learn(&mut self, operator: &str, bytes: u64, estimate: Duration, actual: Duration) {
        let a = self.cfg.learning_rate;
        let prior = self.cfg.prior_ns_per_byte;
        let overhead = self.cfg.overhead;
        let m = self
            .costs
            .entry(operator.to_string())
            .or_insert_with(|| CostModel {
                ns_per_byte: prior,
                samples: 0,
                mean_abs_error: 0.0,
            });
        let err =
            (estimate.as_secs_f64() - actual.as_secs_f64()).abs() / actual.as_secs_f64().max(1e-6);
        m.mean_abs_error = if m.samples == 0 {
            err
        } else {
            (1.0 - a) * m.mean_abs_error + a * err
        };
        // Requests too small to measure the per-byte cost teach nothing about it.
        if bytes >= 64 * 1024 {
            let sample = actual.saturating_sub(overhead).as_nanos() as f64 / bytes as f64;
            m.ns_per_byte = if m.samples == 0 {
                sample
            } else {
                (1.0 - a) * m.ns_per_byte + a * sample
            };
        }
        m.samples += 1;
    }

    /// A queued request predicted to wait `predicted` (unscaled) waited `waited`.
    fn learn_delay(&mut self, predicted: Duration, waited: Duration) {
        if predicted < MIN_PREDICTION {
            return;
        }
        let ratio = (waited.as_secs_f64() / predicted.as_secs_f64()).clamp(0.1, 10.0);
        if self.prediction_ratios.len() == PREDICTION_SAMPLES {
            self.prediction_ratios.pop_front();
        }
        self.prediction_ratios.push_back(ratio as f32);
        self.prediction_samples += 1;
        let n = self.prediction_ratios.len();
        // Learned once there is enough to learn from; recomputed every 16 samples.
        if n >= 32 && self.prediction_samples.is_multiple_of(16) {
            let mut r: Vec<f32> = self.prediction_ratios.iter().copied().collect();
            r.sort_unstable_by(f32::total_cmp);
            let p90 = r[(n - 1) * 9 / 10] as f64;
            self.delay_scale = p90.clamp(0.5, 4.0);
        }
    }

    /// Teaches a request shape its own cost (any size: a shape repeats with about
    /// the same bytes, so its fixed cost folds into its per-byte figure).
    fn learn_shape(&mut self, key: Option<u64>, bytes: u64, actual: Duration) {
        let Some(key) = key.filter(|_| bytes > 0) else {
            return;
        };
        let sample = actual.saturating_sub(self.cfg.overhead).as_nanos() as f64 / bytes as f64;
        self.tick += 1;
        if let Some(c) = self.shapes.get_mut(&key) {
            let a = self.cfg.learning_rate;
            c.ns_per_byte = (1.0 - a) * c.ns_per_byte + a * sample;
            c.used = self.tick;
            return;
        }
        if self.shapes.len() >= MAX_SHAPES {
            let oldest = self
                .shapes
                .iter()
                .min_by_key(|(_, c)| c.used)
                .map(|(k, _)| *k);
            if let Some(k) = oldest {
                self.shapes.remove(&k);
            }
        }
        self.shapes.insert(
            key,
            ShapeCost {
                ns_per_byte: sample,
                used: self.tick,
            },
        );
    }

    fn io_saturated(&self) -> Option<Reject> {
        (self.io_waiting >= self.cfg.io_queue).then(|| {
            let drain =
                self.io_service * (self.io_waiting as u32 / self.cfg.io_in_flight as u32 + 1);
            Reject {
                reason: format!(
                    "the node cannot serve more reads now ({} in flight, {} waiting)",
                    self.io_in_flight, self.io_waiting
                ),
                retry_after: drain.max(Duration::from_millis(10)),
            }
        })
    }

    /// A raw read arrives: `Ok(true)` go now, `Ok(false)` wait (call
    /// [`io_dispatch`](Self::io_dispatch) later), or a rejection.
    pub(crate) fn io_offer(&mut self) -> Result<bool, Reject> {
        if self.io_in_flight < self.cfg.io_in_flight && self.io_waiting == 0 {
            self.io_in_flight += 1;
            return Ok(true);
        }
        if let Some(r) = self.io_saturated() {
            self.counters.rejected += 1;
            return Err(r);
        }
        self.io_waiting += 1;
        Ok(false)
    }

    /// A waiting raw read may start if a read slot is free.
    pub(crate) fn io_dispatch(&mut self) -> bool {
        if self.io_in_flight < self.cfg.io_in_flight && self.io_waiting > 0 {
            self.io_waiting -= 1;
            self.io_in_flight += 1;
            return true;
        }
        false
    }

    /// A waiting raw read gave up.
    pub(crate) fn io_abandon(&mut self) {
        self.io_waiting = self.io_waiting.saturating_sub(1);
    }

    /// A raw read that took `took` ended.
    pub(crate) fn io_finish(&mut self, took: Duration) {
        self.io_in_flight = self.io_in_flight.saturating_sub(1);
        self.io_service = (self.io_service * 4 + took) / 5;
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
            leased: self.leased,
            lease_memory: self.leased_memory,
            memory_budget: self.cfg.memory,
            queue_target_ms: self.cfg.queue_target.as_secs_f64() * 1e3,
            running: self.running.len(),
            waiting: self.tenants.values().map(|t| t.queue.len()).sum(),
            memory_reserved: self.memory_reserved,
            io_in_flight: self.io_in_flight,
            io_waiting: self.io_waiting,
            counters: self.counters.clone(),
            queue_delay_p50_ms: pct(0.5),
            queue_delay_p99_ms: pct(0.99),
            queue_prediction_scale: self.delay_scale,
            costs: self.costs.clone(),
            cost_shapes: self.shapes.len(),
            tenants: self
                .tenants
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
    pub fn lease(&self, tenant: &str, n: usize, memory: u64) -> Result<(), String> {
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
    pub fn set_tenants(&self, tenants: BTreeMap<String, TenantShare>) -> Result<(), String> {
        let mut ctl = self.ctl();
        let reserved: usize = tenants.values().map(|t| t.reserve).sum();
        if reserved > ctl.cfg.slots {
            return Err(format!(
                "tenants reserve {reserved} slots but the node has {} CPU workers",
                ctl.cfg.slots
            ));
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
            kept_for_link: offer.kept_for_link,
            completed: false,
        }
    }

    /// Why a request that queued `waited` (predicted to run `estimate`) waited longer
    /// than the queueing target, in words for its report; `None` within the target.
    pub fn why_waited(
        &self,
        waited: Duration,
        estimate: Duration,
        patient: bool,
        kept_for_link: bool,
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
        Some(if patient {
            "the compute tier was saturated and asked the node to queue it rather than hand it back"
                .into()
        } else if kept_for_link {
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

/// Removes a queued request whose future was dropped (client gone).
struct QueueGuard {
    adm: Arc<Admission>,
    id: u64,
    armed: bool,
}

impl Drop for QueueGuard {
    fn drop(&mut self) {
        if self.armed {
            self.adm
                .waiters
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&self.id);
            let now = self.adm.now();
            let started = self.adm.ctl().abandon(self.id, now);
            self.adm.wake(started);
        }
    }
}

/// A running request's slot; released (and its time learned) when dropped.
#[derive(Debug)]
pub struct Permit {
    adm: Arc<Admission>,
    id: u64,
    started: Instant,
    /// The estimated run time.
    pub estimate: Duration,
    /// The queueing predicted when it was queued (scaled; zero if it ran at once).
    pub predicted: Duration,
    /// How long it waited in the queue.
    pub waited: Duration,
    /// It queued past the delay bound because handing it back was priced slower
    /// for its asker (see "Pricing the link").
    pub kept_for_link: bool,
    completed: bool,
}

impl Permit {
    /// Marks the request as run to completion, so its time teaches the cost model.
    pub fn complete(&mut self) {
        self.completed = true;
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let busy = self.started.elapsed();
        let now = self.adm.now();
        let started = self.adm.ctl().finish(self.id, now, busy, self.completed);
        self.adm.wake(started);
    }
}

/// A raw read's slot.
#[derive(Debug)]
pub struct ReadPermit {
    adm: Arc<Admission>,
    started: Instant,
}

impl Drop for ReadPermit {
    fn drop(&mut self) {
        self.adm.io_release(self.started.elapsed());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn ask(tenant: &str, bytes: u64) -> Ask {
        Ask {
            operator: "sql".into(),
            tenant: tenant.into(),
            bytes,
            memory: 1 << 20,
            patient: false,
            asker: Asker::default(),
            shape: None,
        }
    }

    fn cfg(slots: usize) -> AdmissionConfig {
        let mut c = AdmissionConfig::new(slots, 1 << 30);
        c.prior_ns_per_byte = 1.0; // 1 MB = 1 ms
        c.overhead = Duration::ZERO;
        c
    }

    fn id(o: &Offer) -> u64 {
        match o {
            Offer::Run(i) | Offer::Queued(i) => *i,
            other => panic!("expected run or queue, got {other:?}"),
        }
    }

    #[test]
    fn handing_back_is_priced_by_the_askers_link_and_load() {
        let mut c = Controller::new(cfg(1));
        let t = Duration::ZERO;
        // 20 ms of work each, one slot, target 50 ms: 20 running + 40 queued ahead.
        for _ in 0..3 {
            id(&c.offer(ask("x", 20_000_000), t));
        }
        let with = |link_mbit: f64, load: f64| Ask {
            asker: Asker {
                link_bytes_per_s: Some(link_mbit * 1e6 / 8.0),
                ns_per_byte: None,
                load,
                backlog_bytes: 0,
            },
            ..ask("x", 20_000_000)
        };
        // Here: 60 ms queued + 20 ms run. There, over 3.2 Gbit/s with idle cores:
        // 50 ms of link + 20 ms of decoding.
        match c.offer(with(3_200.0, 0.0), t) {
            Offer::PushBack(p) => assert!(p.reason.contains("sooner"), "{}", p.reason),
            o => panic!("expected push back, got {o:?}"),
        }
        // The same link, but each of the asker's cores has a fragment to finish
        // first: 50 + 20 + 20 ms there.
        assert!(matches!(c.offer(with(3_200.0, 1.0), t), Offer::Queued(_)));
        assert_eq!(c.stats().counters.kept_for_link, 1);
        // A load past 1 (or nonsense) counts as 1 or 0.
        match c.offer(with(3_200.0, f64::NAN), t) {
            Offer::PushBack(_) => {}
            o => panic!("expected push back, got {o:?}"),
        }
        // Here now 80 + 20. There, over 100 Mbit/s: 1.6 s of link.
        assert!(matches!(c.offer(with(100.0, 0.0), t), Offer::Queued(_)));
        // An unknown link is not priced: the plain rule pushes it back.
        assert!(matches!(
            c.offer(ask("x", 20_000_000), t),
            Offer::PushBack(_)
        ));
        assert_eq!(c.stats().counters.kept_for_link, 2);
        // Here 100 + 20 ms. There, over 3.2 Gbit/s behind 40 MB handed back to the
        // same link before: 150 ms of link + 20 of decoding. Without them, 70 ms.
        match c.offer(with(3_200.0, 0.0), t) {
            Offer::PushBack(p) => assert_eq!(p.bytes, 20_000_000),
            o => panic!("expected push back, got {o:?}"),
        }
        let behind = Ask {
            asker: Asker {
                backlog_bytes: 40_000_000,
                ..with(3_200.0, 0.0).asker
            },
            ..ask("x", 20_000_000)
        };
        assert!(matches!(c.offer(behind, t), Offer::Queued(_)));
        assert_eq!(c.stats().counters.kept_for_link, 3);
    }

    #[test]
    fn runs_then_queues_within_target_then_pushes_back() {
        let mut c = Controller::new(cfg(1));
        let t = Duration::ZERO;
        // 20 ms of work each, one slot, target 50 ms.
        let a = c.offer(ask("x", 20_000_000), t);
        assert!(matches!(a, Offer::Run(_)));
        // Residual 20 ms: queue.
        assert!(matches!(c.offer(ask("x", 20_000_000), t), Offer::Queued(_)));
        // Residual 20 + 20 queued = 40 ms: queue.
        assert!(matches!(c.offer(ask("x", 20_000_000), t), Offer::Queued(_)));
        // 20 + 40 = 60 ms > 50: push back, with the prediction.
        match c.offer(ask("x", 20_000_000), t) {
            Offer::PushBack(p) => {
                assert!((p.predicted_delay_ms - 60.0).abs() < 0.01, "{p:?}");
                assert!(p.reason.contains("busy"), "{}", p.reason);
            }
            o => panic!("expected push back, got {o:?}"),
        }
        // 15 ms later the running one has 5 ms left: 5 + 40 = 45 ms, queue again.
        assert!(matches!(
            c.offer(ask("x", 20_000_000), 15 * MS),
            Offer::Queued(_)
        ));
        // 5 + 60 = 65 ms > 50, but the asker is saturated itself: it queues.
        let patient = Ask {
            patient: true,
            ..ask("x", 20_000_000)
        };
        assert!(matches!(c.offer(patient, 15 * MS), Offer::Queued(_)));
        let s = c.stats();
        assert_eq!((s.running, s.waiting, s.counters.pushed_back), (1, 4, 1));
        assert_eq!(s.counters.patient, 1);
        // Finishing dispatches the oldest waiting request, which waited 20 ms.
        let started = c.finish(id(&a), 20 * MS, 20 * MS, true);
        assert_eq!(started.len(), 1);
        assert_eq!(started[0].1, 20 * MS);
    }

    #[test]
    fn cost_is_learned_from_finished_requests() {
        let mut c = Controller::new(cfg(1));
        // Prior: 1 ns/byte; actual: 5 ns/byte.
        for i in 0..30u64 {
            let now = Duration::from_millis(i * 100);
            let o = c.offer(ask("x", 10_000_000), now);
            c.finish(id(&o), now + 50 * MS, 50 * MS, true);
        }
        let m = &c.stats().costs["sql"];
        assert!((m.ns_per_byte - 5.0).abs() < 0.01, "{m:?}");
        assert!(m.mean_abs_error < 0.01, "{m:?}");
        assert_eq!(c.estimate(&ask("x", 10_000_000)), 50 * MS);
        // An abandoned or failed run teaches nothing.
        let o = c.offer(ask("x", 10_000_000), Duration::from_secs(10));
        c.finish(
            id(&o),
            Duration::from_secs(11),
            Duration::from_secs(1),
            false,
        );
        assert!((c.stats().costs["sql"].ns_per_byte - 5.0).abs() < 0.01);
    }

    #[test]
    fn repeated_shapes_learn_their_own_cost_and_are_bounded() {
        let mut c = Controller::new(cfg(1));
        let shaped = |shape: u64| Ask {
            shape: Some(shape),
            ..ask("x", 10_000_000)
        };
        // Two shapes of one operator, alternating: 1 and 9 ns/byte.
        for i in 0..40u64 {
            let now = Duration::from_millis(i * 200);
            let (shape, took) = if i % 2 == 0 {
                (1, 10 * MS)
            } else {
                (2, 90 * MS)
            };
            let o = c.offer(shaped(shape), now);
            c.finish(id(&o), now + took, took, true);
        }
        let near = |d: Duration, ms: f64| (d.as_secs_f64() * 1e3 - ms).abs() < 0.01;
        // Each shape is estimated from its own runs, not the operator's mean.
        assert!(
            near(c.estimate(&shaped(1)), 10.0),
            "{:?}",
            c.estimate(&shaped(1))
        );
        assert!(
            near(c.estimate(&shaped(2)), 90.0),
            "{:?}",
            c.estimate(&shaped(2))
        );
        // An unseen shape, or none, falls back to the operator's mean (between).
        let mean = c.estimate(&shaped(3));
        assert!(mean > 20 * MS && mean < 80 * MS, "{mean:?}");
        assert_eq!(c.estimate(&ask("x", 10_000_000)), mean);
        assert_eq!(c.stats().cost_shapes, 2);
        // At most MAX_SHAPES are kept; the least recently used goes first.
        for s in 0..MAX_SHAPES as u64 {
            let now = Duration::from_secs(100) + Duration::from_millis(s);
            if s == 10 {
                // Shape 2 is asked for again, so shape 1 is now the oldest.
                let o = c.offer(shaped(2), now);
                c.finish(id(&o), now, Duration::ZERO, false);
            }
            let o = c.offer(shaped(1000 + s), now);
            c.finish(id(&o), now, MS, true);
        }
        assert_eq!(c.stats().cost_shapes, MAX_SHAPES);
        assert!(near(c.estimate(&shaped(2)), 90.0), "recently used: kept");
        assert_eq!(
            c.estimate(&shaped(1)),
            c.estimate(&ask("x", 10_000_000)),
            "least recently used: forgotten"
        );
    }

    #[test]
    fn queueing_predictions_are_scaled_by_their_recent_error() {
        let mut c = Controller::new(cfg(1));
        // 10 MB requests are estimated at 10 ms but hold the slot 30 ms (finished
        // without teaching the cost model: only the queueing prediction can learn).
        let mut now = Duration::ZERO;
        let mut running = id(&c.offer(ask("x", 10_000_000), now));
        for i in 0..40 {
            let next = c.offer(ask("x", 10_000_000), now);
            assert!(matches!(next, Offer::Queued(_)), "{next:?}");
            if i < 31 {
                assert_eq!(c.stats().queue_prediction_scale, 1.0, "not learned yet");
            }
            now += 30 * MS;
            let started = c.finish(running, now, 30 * MS, false);
            assert_eq!(started, vec![(id(&next), 30 * MS)]);
            running = id(&next);
        }
        // Predicted 10 ms, waited 30: the scale is 3.
        assert!((c.stats().queue_prediction_scale - 3.0).abs() < 1e-6);
        // One running (10 ms residual): queued, predicted 30 ms.
        assert!(matches!(
            c.offer(ask("x", 10_000_000), now),
            Offer::Queued(_)
        ));
        // 20 ms ahead unscaled (within the 50 ms target), 60 ms scaled: pushed back.
        match c.offer(ask("x", 10_000_000), now) {
            Offer::PushBack(p) => assert!((p.predicted_delay_ms - 60.0).abs() < 0.01, "{p:?}"),
            o => panic!("expected push back, got {o:?}"),
        }
    }

    #[test]
    fn a_flooding_tenant_does_not_starve_another() {
        let mut c = Controller::new(cfg(2));
        let t0 = Duration::ZERO;
        let mut running = Vec::new();
        // Tenant "flood" fills both slots and the queue up to its delay target.
        let mut pushed = 0;
        for _ in 0..40 {
            match c.offer(ask("flood", 10_000_000), t0) {
                Offer::Run(i) => running.push(i),
                Offer::Queued(_) => {}
                Offer::PushBack(_) => pushed += 1,
                o => panic!("{o:?}"),
            }
        }
        assert_eq!(running.len(), 2);
        assert!(
            pushed > 20,
            "the flood is pushed back once its queue is full: {pushed}"
        );
        // The quiet tenant's request is queued (its own queue is empty, so its
        // predicted delay is the residual only) ...
        let quiet = c.offer(ask("quiet", 10_000_000), t0);
        assert!(matches!(quiet, Offer::Queued(_)), "{quiet:?}");
        // ... and starts with the first free slot, ahead of the flood's backlog.
        let started = c.finish(running[0], 10 * MS, 10 * MS, true);
        assert_eq!(started.len(), 1);
        assert_eq!(started[0].0, id(&quiet));
    }

    #[test]
    fn leases_keep_the_reserves_and_a_slot_and_shrink_what_admitted_work_sees() {
        let mut cf = cfg(4);
        cf.policy = Policy::Always;
        cf.tenants.insert(
            "etl".into(),
            TenantShare {
                weight: 1.0,
                reserve: 2,
            },
        );
        let mut c = Controller::new(cf);
        // etl reserves 2 of 4 slots: others may lease at most 2 (etl itself 3).
        let e = c.lease("bulk", 3, 0).unwrap_err();
        assert!(e.contains("cannot be leased"), "{e}");
        c.lease("bulk", 2, 0).unwrap();
        assert!(
            c.lease("bulk", 1, 0).is_err(),
            "the reserves hold under a lease flood"
        );
        assert_eq!(c.stats().leased, 2);
        // Admitted work sees 2 slots: the third request waits.
        let t0 = Duration::ZERO;
        let a = c.offer(ask("bulk", 1_000_000), t0);
        let b = c.offer(ask("bulk", 1_000_000), t0);
        let q = c.offer(ask("bulk", 1_000_000), t0);
        assert!(
            matches!(a, Offer::Run(_)) && matches!(b, Offer::Run(_)),
            "{a:?} {b:?}"
        );
        assert!(matches!(q, Offer::Queued(_)), "{q:?}");
        // Slots given back: the queued request can start.
        c.unlease("bulk", 2, 0);
        let started = c.dispatch(MS);
        assert_eq!(started.len(), 1, "{started:?}");
        // Under load, a lease waits for idle slots.
        let d = c.offer(ask("bulk", 1_000_000), t0);
        assert!(matches!(d, Offer::Run(_)), "{d:?}");
        let e = c.lease("bulk", 1, 0).unwrap_err();
        assert!(e.contains("idle"), "{e}");
        assert_eq!(
            c.lease("bulk", 0, 0).unwrap_err(),
            "a lease needs at least one slot"
        );
    }

    #[test]
    fn a_tenants_leases_count_toward_its_reserve_and_lease_memory_is_held() {
        let mut cf = cfg(4);
        cf.policy = Policy::Always;
        cf.memory = 100 << 20;
        cf.tenants.insert(
            "etl".into(),
            TenantShare {
                weight: 1.0,
                reserve: 2,
            },
        );
        let mut c = Controller::new(cf);
        // etl may lease into its own reserve (others could lease only 2 of 4).
        c.lease("etl", 2, 0).unwrap();
        let t0 = Duration::ZERO;
        assert!(matches!(c.offer(ask("etl", 1_000), t0), Offer::Run(_)));
        // etl's next request waits for memory, with a slot free.
        let waiting = c.offer(
            Ask {
                memory: 100 << 20,
                ..ask("etl", 1_000)
            },
            t0,
        );
        assert!(matches!(waiting, Offer::Queued(_)), "{waiting:?}");
        // Its reserve is met by its lease and its running request: the free slot is
        // not held back from others for it.
        assert_eq!(c.free_for("bulk"), 1);
        c.unlease("etl", 2, 0);
        assert!(c.leased_by.is_empty());
        // Memory a lease holds is not offered to admitted work.
        c.lease("bulk", 1, 60 << 20).unwrap();
        let big = 50 << 20;
        assert!(!c.memory_fits(big));
        let e = c.lease("bulk", 1, 60 << 20).unwrap_err();
        assert!(e.contains("memory"), "{e}");
        c.unlease("bulk", 1, 60 << 20);
        assert!(c.memory_fits(big));
    }

    #[test]
    fn weights_split_the_slots() {
        let mut cf = cfg(1);
        cf.policy = Policy::Always;
        cf.tenants.insert(
            "gold".into(),
            TenantShare {
                weight: 3.0,
                reserve: 0,
            },
        );
        let mut c = Controller::new(cf);
        let t0 = Duration::ZERO;
        let first = id(&c.offer(ask("bronze", 1_000_000), t0));
        let mut owner = HashMap::new();
        for _ in 0..40 {
            owner.insert(id(&c.offer(ask("gold", 1_000_000), t0)), "gold");
            owner.insert(id(&c.offer(ask("bronze", 1_000_000), t0)), "bronze");
        }
        let mut order = Vec::new();
        let mut cur = first;
        for k in 1..=40u32 {
            let s = c.finish(cur, MS * k, MS, true);
            cur = s[0].0;
            order.push(owner[&cur]);
        }
        let gold = order.iter().filter(|o| **o == "gold").count();
        assert!(
            (28..=32).contains(&gold),
            "gold got {gold} of 40: {order:?}"
        );
    }

    #[test]
    fn reserves_hold_slots_back() {
        let mut cf = cfg(2);
        cf.tenants.insert(
            "vip".into(),
            TenantShare {
                weight: 1.0,
                reserve: 1,
            },
        );
        let mut c = Controller::new(cf);
        let t0 = Duration::ZERO;
        assert!(matches!(
            c.offer(ask("other", 1_000_000), t0),
            Offer::Run(_)
        ));
        // The vip has no work: the other may take the second slot too.
        let b = c.offer(ask("other", 1_000_000), t0);
        assert!(matches!(b, Offer::Run(_)));
        // Both busy; a vip request queues and gets the next slot.
        let v = c.offer(ask("vip", 1_000_000), t0);
        let o = c.offer(ask("other", 1_000_000), t0);
        assert!(matches!((&v, &o), (Offer::Queued(_), Offer::Queued(_))));
        let started = c.finish(id(&b), MS, MS, true);
        assert_eq!(started, vec![(id(&v), MS)]);
    }

    #[test]
    fn a_long_wait_says_why() {
        let ms = Duration::from_millis;
        let mut cf = AdmissionConfig::new(1, 1 << 30);
        cf.queue_target = ms(50);
        let adaptive = Admission::new(cf.clone());
        assert_eq!(adaptive.why_waited(ms(40), ms(10), false, false), None);
        let own = adaptive.why_waited(ms(300), ms(200), false, false).unwrap();
        assert!(own.contains("own run time (200.0 ms)"), "{own}");
        let wrong = adaptive
            .why_waited(ms(2000), ms(100), false, false)
            .unwrap();
        assert!(wrong.contains("prediction was wrong"), "{wrong}");
        let patient = adaptive
            .why_waited(ms(10_800), ms(100), true, false)
            .unwrap();
        assert!(patient.contains("compute tier was saturated"), "{patient}");
        let link = adaptive.why_waited(ms(400), ms(100), false, true).unwrap();
        assert!(link.contains("priced slower"), "{link}");
        cf.policy = Policy::Always;
        let always = Admission::new(cf)
            .why_waited(ms(2000), ms(100), false, false)
            .unwrap();
        assert!(always.contains("policy always"), "{always}");
    }

    #[test]
    fn memory_bounds_what_runs() {
        let mut cf = cfg(4);
        cf.memory = 100 << 20;
        let mut c = Controller::new(cf);
        let t0 = Duration::ZERO;
        let big = |mb: u64| Ask {
            memory: mb << 20,
            ..ask("x", 1_000_000)
        };
        let a = c.offer(big(60), t0);
        assert!(matches!(a, Offer::Run(_)));
        // Slots are free but memory is not: it waits.
        let b = c.offer(big(60), t0);
        assert!(matches!(b, Offer::Queued(_)));
        assert!(c.stats().memory_reserved <= 100 << 20);
        // More than the whole budget: pushed back at once.
        match c.offer(big(200), t0) {
            Offer::PushBack(p) => assert!(p.reason.contains("memory"), "{}", p.reason),
            o => panic!("{o:?}"),
        }
        let started = c.finish(id(&a), MS, MS, true);
        assert_eq!(started[0].0, id(&b));
        assert_eq!(c.stats().memory_reserved, 60 << 20);
    }

    #[test]
    fn policies_always_and_never() {
        let mut cf = cfg(1);
        cf.policy = Policy::Never;
        let mut c = Controller::new(cf.clone());
        assert!(matches!(
            c.offer(ask("x", 1), Duration::ZERO),
            Offer::PushBack(_)
        ));
        cf.policy = Policy::Always;
        cf.max_queued = 3;
        let mut c = Controller::new(cf);
        let outcomes: Vec<Offer> = (0..5)
            .map(|_| c.offer(ask("x", 100_000_000), Duration::ZERO))
            .collect();
        assert!(matches!(outcomes[0], Offer::Run(_)));
        assert!(outcomes[1..4].iter().all(|o| matches!(o, Offer::Queued(_))));
        assert!(
            matches!(outcomes[4], Offer::PushBack(_)),
            "queue bound holds"
        );
    }

    #[test]
    fn raw_reads_reject_only_when_saturated() {
        let mut cf = cfg(1);
        cf.io_in_flight = 2;
        cf.io_queue = 2;
        let mut c = Controller::new(cf);
        assert_eq!(c.io_offer(), Ok(true));
        assert_eq!(c.io_offer(), Ok(true));
        assert_eq!(c.io_offer(), Ok(false));
        assert_eq!(c.io_offer(), Ok(false));
        let r = c.io_offer().unwrap_err();
        assert!(r.retry_after >= Duration::from_millis(10));
        // An operator request that would be pushed back is rejected instead: the
        // compute tier could not read the ranges either.
        let mut busy = c.config().clone();
        busy.policy = Policy::Never;
        let mut c2 = Controller::new(busy);
        for _ in 0..4 {
            let _ = c2.io_offer();
        }
        assert!(matches!(
            c2.offer(ask("x", 1), Duration::ZERO),
            Offer::Reject(_)
        ));
        // Reads finish, waiting ones start.
        c.io_finish(MS);
        assert!(c.io_dispatch());
        assert!(!c.io_dispatch());
        assert_eq!(c.stats().counters.rejected, 1);
    }

    #[test]
    fn parses_tenants() {
        assert_eq!(
            parse_tenant("etl=2:1").unwrap(),
            (
                "etl".into(),
                TenantShare {
                    weight: 2.0,
                    reserve: 1
                }
            )
        );
        assert_eq!(parse_tenant("bi=0.5").unwrap().1.reserve, 0);
        for bad in ["etl", "etl=0", "etl=-1", "=2", "etl=2:x", "etl=nan"] {
            assert!(parse_tenant(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn queued_permits_are_woken_and_abandoned_ones_skipped() {
        let mut cf = cfg(1);
        cf.queue_target = Duration::from_secs(10);
        let adm = Admission::new(cf);
        let p1 = adm.admit(ask("x", 1_000_000)).await.unwrap();
        // A queued request whose client goes away.
        let gone = tokio::spawn({
            let adm = adm.clone();
            async move { adm.admit(ask("x", 1_000_000)).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let waiting = tokio::spawn({
            let adm = adm.clone();
            async move { adm.admit(ask("x", 1_000_000)).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(adm.stats().waiting, 2);
        gone.abort();
        let _ = gone.await;
        assert_eq!(adm.stats().waiting, 1);
        drop(p1);
        let p3 = waiting.await.unwrap().unwrap();
        assert!(p3.waited >= Duration::from_millis(15), "{:?}", p3.waited);
        assert_eq!(adm.stats().running, 1);
        drop(p3);
        let s = adm.stats();
        assert_eq!((s.running, s.waiting, s.counters.abandoned), (0, 0, 1));
    }
}
