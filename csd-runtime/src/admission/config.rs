//! Admission's settings: slots, memory, the queueing target, the policy, costs'
//! priors, tenants' shares and reserves, raw-read limits.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use csd_protocol::stats::Policy;
use csd_protocol::{Error, Result};

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
pub(crate) fn parse_tenant(s: &str) -> Result<(String, TenantShare)> {
    let bad = |why: String| Error::InvalidArgument(why);
    let (name, rest) = s
        .split_once('=')
        .ok_or_else(|| bad(format!("tenant {s:?}: expected name=weight[:reserve]")))?;
    let (w, r) = match rest.split_once(':') {
        Some((w, r)) => (w, Some(r)),
        None => (rest, None),
    };
    let weight: f64 = w
        .parse()
        .ok()
        .filter(|w: &f64| w.is_finite() && *w > 0.0)
        .ok_or_else(|| {
            bad(format!(
                "tenant {name}: weight {w:?} must be a positive number"
            ))
        })?;
    let reserve = match r {
        Some(r) => r
            .parse()
            .map_err(|_| bad(format!("tenant {name}: reserve {r:?} must be a slot count")))?,
        None => 0,
    };
    if name.is_empty() {
        return Err(bad(format!("tenant {s:?}: empty name")));
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
    /// Whether the prior is known to fit this node's cores. When not (the default:
    /// it is a server's figure), a request that would have to wait before any
    /// request of its kind has finished here is handed back under `adaptive`.
    pub(crate) trust_prior: bool,
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
    /// `tenant`'s weight and reserve (weight 1, no reserve for a tenant not named).
    pub(super) fn share(&self, tenant: &str) -> TenantShare {
        self.tenants.get(tenant).copied().unwrap_or_default()
    }

    /// Defaults for a node with `slots` CPU workers and `memory` bytes.
    pub fn new(slots: usize, memory: u64) -> Self {
        AdmissionConfig {
            slots: slots.max(1),
            memory,
            queue_target: Duration::from_millis(50),
            max_queued: 1024,
            policy: Policy::Adaptive,
            prior_ns_per_byte: 2.0,
            trust_prior: false,
            link_prior: None,
            overhead: Duration::from_micros(500),
            learning_rate: 0.2,
            tenants: BTreeMap::new(),
            io_in_flight: 64,
            io_queue: 4096,
        }
    }
}
