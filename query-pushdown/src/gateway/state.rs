//! What every call to the gateway shares: the nodes' connections, the session
//! settings, its counters, the answers streaming now and callers' sessions.

use std::sync::Arc;

use csd_protocol::Error;
use csd_protocol::node_client::NodeClient;

use super::auth::Caller;
use super::running::Running;
use super::sessions::Sessions;
use super::stats::{Counters, bump};
use crate::compute::session::{Cluster, CsdSession, SessionOptions};
use crate::error::to_runtime;

/// The Flight SQL service over a cluster.
pub(crate) struct Gateway {
    /// One connection per node, shared by all callers (each asks with its token).
    nodes: Vec<NodeClient>,
    session: SessionOptions,
    pub(super) counters: Arc<Counters>,
    pub(super) running: Arc<Running>,
    sessions: Sessions,
}

impl Gateway {
    /// A gateway asking `nodes` (one connection each) with `session`'s settings.
    pub(super) fn new(nodes: Vec<NodeClient>, session: SessionOptions) -> Self {
        Gateway {
            nodes,
            session,
            counters: Arc::default(),
            running: Arc::default(),
            sessions: Sessions::default(),
        }
    }

    /// The caller of a request, counted; a malformed `authorization` is refused.
    pub(crate) fn caller(&self, metadata: &tonic::metadata::MetadataMap) -> Result<Caller, Error> {
        let caller = Caller::of(metadata).inspect_err(|_| bump(&self.counters.unauthenticated))?;
        self.counters.seen(caller.digest());
        Ok(caller)
    }

    /// A session over the cluster asking the nodes as `caller` (the nodes check its
    /// token against their tenants); one made in the last moments is reused.
    pub(crate) async fn session(&self, caller: &Caller) -> Result<Arc<CsdSession>, Error> {
        match self.sessions.get(&caller.digest()) {
            Some(s) => Ok(s),
            None => self.new_session(caller).await,
        }
    }

    /// A new session for `caller` (its tables listed by the nodes now, its token
    /// checked by them), kept for its next calls.
    pub(crate) async fn new_session(&self, caller: &Caller) -> Result<Arc<CsdSession>, Error> {
        let session = Arc::new(self.listed(caller).await?);
        self.sessions.put(caller.digest(), session.clone());
        Ok(session)
    }

    async fn listed(&self, caller: &Caller) -> Result<CsdSession, Error> {
        let nodes = self
            .nodes
            .iter()
            .map(|n| n.clone().with_token(caller.token.as_deref()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| Error::external(e.status_code(), "the caller's token", e))?;
        Cluster::from_clients(nodes)
            .session(self.session)
            .await
            .map_err(to_runtime)
            .inspect_err(|e| {
                if e.status_code() == csd_protocol::StatusCode::Unauthenticated {
                    bump(&self.counters.unauthenticated);
                }
            })
    }
}
