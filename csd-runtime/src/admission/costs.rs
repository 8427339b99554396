//! Cost learning: a request's per-byte cost, learned online per operator (an
//! exponentially weighted mean over finished requests, no pre-profiling) and apart
//! per repeated request shape (the same plan over another partition, or again: one
//! SQL fragment may cost ten times another per byte, and a mean over both
//! mispredicts each). The shapes kept are bounded; the least recently used go.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use super::ask::{Ask, CostKey};
use super::config::AdmissionConfig;
use csd_protocol::stats::CostModel;

/// Request shapes whose costs are kept at most.
pub(super) const MAX_SHAPES: usize = 1024;

/// The key a shape's cost is kept under: its operator's cost key and the shape.
pub(super) fn shape_key(operator: &CostKey, shape: Option<u64>) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let shape = shape?;
    let mut h = std::hash::DefaultHasher::new();
    operator.hash(&mut h);
    shape.hash(&mut h);
    Some(h.finish())
}

/// A repeated request shape's learned cost.
#[derive(Debug)]
struct ShapeCost {
    ns_per_byte: f64,
    /// When it was last estimated or learned (the book's tick).
    used: u64,
}

/// What the node has learned of its requests' costs.
#[derive(Debug)]
pub(super) struct Costs {
    /// Cost per byte before anything was learned.
    prior: f64,
    /// Fixed cost of a request.
    overhead: Duration,
    /// Weight of a new sample.
    rate: f64,
    operators: BTreeMap<CostKey, CostModel>,
    /// Per [`shape_key`]: its own learned cost.
    shapes: HashMap<u64, ShapeCost>,
    /// Counts estimates and lessons, to find the least recently used shape.
    tick: u64,
}

impl Costs {
    /// Nothing learned yet, with `cfg`'s prior, overhead and learning rate.
    pub(super) fn new(cfg: &AdmissionConfig) -> Self {
        Costs {
            prior: cfg.prior_ns_per_byte,
            overhead: cfg.overhead,
            rate: cfg.learning_rate,
            operators: BTreeMap::new(),
            shapes: HashMap::new(),
            tick: 0,
        }
    }

    /// The learned cost of `operator` per byte read.
    fn ns_per_byte(&self, operator: &CostKey) -> f64 {
        self.operators
            .get(operator)
            .map(|c| c.ns_per_byte)
            .unwrap_or(self.prior)
    }

    /// Whether any request of `operator` has finished here: until one has, its cost
    /// is the configured prior, which says nothing about this node's cores.
    pub(super) fn learned(&self, operator: &CostKey) -> bool {
        self.operators.get(operator).is_some_and(|c| c.samples > 0)
    }

    /// The learned cost per byte of `ask`: its shape's if one was learned, else its
    /// operator's.
    pub(super) fn ns_per_byte_of(&self, ask: &Ask) -> f64 {
        shape_key(&ask.operator, ask.shape)
            .and_then(|k| self.shapes.get(&k))
            .map(|c| c.ns_per_byte)
            .unwrap_or_else(|| self.ns_per_byte(&ask.operator))
    }

    /// The estimated run time of `ask` from the learned cost.
    pub(super) fn estimate(&self, ask: &Ask) -> Duration {
        let per_byte = self.ns_per_byte_of(ask);
        self.overhead + Duration::from_nanos((ask.bytes as f64 * per_byte).min(1e15) as u64)
    }

    /// `ask`'s shape was just estimated: it is not the least recently used.
    pub(super) fn touch(&mut self, ask: &Ask) {
        self.tick += 1;
        if let Some(c) = shape_key(&ask.operator, ask.shape).and_then(|k| self.shapes.get_mut(&k)) {
            c.used = self.tick;
        }
    }

    /// A request of `operator` (and shape `shape`, its [`shape_key`]) that read
    /// `bytes`, estimated at `estimate`, ran to completion in `actual`.
    pub(super) fn learn(
        &mut self,
        operator: &CostKey,
        shape: Option<u64>,
        bytes: u64,
        estimate: Duration,
        actual: Duration,
    ) {
        self.learn_operator(operator, bytes, estimate, actual);
        self.learn_shape(shape, bytes, actual);
    }

    fn learn_operator(
        &mut self,
        operator: &CostKey,
        bytes: u64,
        estimate: Duration,
        actual: Duration,
    ) {
        let (a, prior, overhead) = (self.rate, self.prior, self.overhead);
        let m = self
            .operators
            .entry(operator.clone())
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

    /// Teaches a request shape its own cost (any size: a shape repeats with about
    /// the same bytes, so its fixed cost folds into its per-byte figure).
    fn learn_shape(&mut self, key: Option<u64>, bytes: u64, actual: Duration) {
        let Some(key) = key.filter(|_| bytes > 0) else {
            return;
        };
        let sample = actual.saturating_sub(self.overhead).as_nanos() as f64 / bytes as f64;
        self.tick += 1;
        if let Some(c) = self.shapes.get_mut(&key) {
            c.ns_per_byte = (1.0 - self.rate) * c.ns_per_byte + self.rate * sample;
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

    /// Learned costs per cost key, as node figures show them.
    pub(super) fn operators(&self) -> BTreeMap<String, CostModel> {
        self.operators
            .iter()
            .map(|(k, c)| (k.to_string(), c.clone()))
            .collect()
    }

    /// Shapes with a cost of their own.
    pub(super) fn shapes(&self) -> usize {
        self.shapes.len()
    }
}
