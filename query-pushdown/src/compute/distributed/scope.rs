//! What decoding a plan on a worker needs ([`DecodeScope`], a session extension):
//! the worker's [`WorkerEnv`] to connect scans to their nodes, and the key
//! collectors met so far in the plan, so a scan finds the collector of its join.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use csd_protocol::node_client::NodeClient;
use datafusion::common::Result;

use super::env::WorkerEnv;
use super::keys::FlightKeyBoard;
use crate::compute::gate::LocalGate;
use crate::compute::key_collector::{KeyCollector, KeyMeeting};
use crate::compute::range_read::NodeRangeStore;
use crate::compute::scan::codec::ScanDecoding;

/// What decoding one plan on a worker shares: the worker's connections and the
/// collectors met so far in this plan.
pub(crate) struct DecodeScope {
    env: Arc<WorkerEnv>,
    collectors: Mutex<HashMap<u64, Arc<KeyCollector>>>,
}

impl DecodeScope {
    pub(crate) fn new(env: Arc<WorkerEnv>) -> Self {
        DecodeScope {
            env,
            collectors: Mutex::new(HashMap::new()),
        }
    }

    /// The collector `id` of the plan being decoded, if it is in the same plan.
    pub(crate) fn collector(&self, id: u64) -> Option<Arc<KeyCollector>> {
        self.collectors().get(&id).cloned()
    }

    pub(super) fn collectors(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<KeyCollector>>> {
        self.collectors
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl ScanDecoding for DecodeScope {
    fn ranges(&self) -> Arc<NodeRangeStore> {
        self.env.ranges().clone()
    }

    fn node(&self, url: &str) -> Result<(NodeClient, usize)> {
        self.env.node(url)
    }

    fn local(&self) -> Arc<LocalGate> {
        self.env.local().clone()
    }

    fn collector(&self, id: u64) -> Option<Arc<KeyCollector>> {
        DecodeScope::collector(self, id)
    }

    fn key_meeting(&self) -> Arc<dyn KeyMeeting> {
        Arc::new(FlightKeyBoard)
    }
}
