//! What a request asks of admission ([`Ask`], with its asker's side, [`Asker`]), what
//! admission answers ([`Offer`], [`Reject`]), and a request waiting in the queue.

use std::fmt;
use std::time::Duration;

use csd_protocol::ModuleDigest;
use csd_protocol::messages::PushBack;

/// What admission learns a request's per-byte cost under.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CostKey {
    /// Every request of an operator (by its name).
    Operator(String),
    /// The requests of an operator that run a shipped module, apart from its
    /// others: a module costs what its code costs, whatever the operator around it.
    Module {
        /// The operator's name.
        operator: String,
        /// The module (a SQL fragment's first, when it calls several).
        module: ModuleDigest,
    },
}

/// As node figures show it: `sql`, or `sql:0123abcd` (the module's short digest).
impl fmt::Display for CostKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CostKey::Operator(name) => f.write_str(name),
            CostKey::Module { operator, module } => write!(f, "{operator}:{}", module.short()),
        }
    }
}

impl From<&str> for CostKey {
    fn from(operator: &str) -> Self {
        CostKey::Operator(operator.to_string())
    }
}

/// What a request asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct Ask {
    /// What its cost is learned under.
    pub operator: CostKey,
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
    /// Fraction of the asker's cores busy, 0 to 1.
    pub load: f64,
    /// Bytes of work this node handed back to the asker's link moments ago that the
    /// link has not carried yet: a fragment handed back now crosses it after them.
    pub backlog_bytes: u64,
    /// The asker runs on this node's host, on cores this node uses too.
    pub shares_cores: bool,
}

/// Why a request queued past the delay bound rather than being handed back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    /// Its asker was saturated and sent it patient.
    Patient,
    /// Handing it back was priced slower for its asker (link and cores).
    ForLink,
    /// Its asker runs on this node's own cores.
    SharedCores,
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

/// A request waiting in its tenant's queue.
#[derive(Debug)]
pub(super) struct Waiting {
    pub(super) id: u64,
    pub(super) ask: Ask,
    pub(super) estimate: Duration,
    pub(super) since: Duration,
    /// The queueing the model predicted for it, unscaled.
    pub(super) predicted: Duration,
}
