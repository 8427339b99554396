//! What one endpoint of a scan did for one execution: read by `EXPLAIN ANALYZE`,
//! `csd sql` and the testbed.

use csd_protocol::OperatorReport;
use csd_protocol::node_client::{Declined, Tried};

/// What one endpoint did for one execution.
#[derive(Debug, Clone, Default)]
pub struct EndpointRun {
    /// `node-url/partition`.
    pub endpoint: String,
    /// Bytes received from the node (Arrow IPC, after compression).
    pub bytes_received: u64,
    /// The node's report.
    pub report: OperatorReport,
    /// Set when the fragment was evaluated here over byte-range reads after the
    /// copy asked last declined it (why: handed back, or its node lost).
    pub pushed_back: Option<Declined>,
    /// A scan that reduces nothing, read here by byte range (see
    /// [`CsdScanExec::direct`](super::CsdScanExec::direct)).
    pub direct: bool,
    /// The partition's copies asked that did not run it, each with why (its node
    /// lost, see `crate::compute::replicas`, or busy): those before the one that
    /// ran it, or all when it ran here (not a lone copy's hand-back, which
    /// `pushed_back` says).
    pub failed_over: Vec<Tried>,
}

impl EndpointRun {
    /// Whether the node handed back work it was asked to do, which the compute tier
    /// then did. A direct scan handed back is not: it is read by byte range, as it
    /// would have been without its join-key filter (the node declines one whose filter
    /// keeps most rows, whatever its load).
    pub fn work_pushed_back(&self) -> bool {
        self.pushed_back
            .as_ref()
            .is_some_and(Declined::handed_back_work)
            && !self.direct
    }
}
