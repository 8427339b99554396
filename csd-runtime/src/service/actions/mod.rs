//! `DoAction`: each action its own handler, chosen by its name here. The actions
//! and their typed bodies are [`crate::protocol::actions`]; a body is decoded once,
//! by the handler, into its request type.

mod attachments;
mod leases;
mod modules;
mod node;
mod refs;

use arrow_flight::Action;

use super::FlightNode;
use crate::auth::Principal;
use crate::error::{Error, Result, truncated};
use crate::protocol::actions::{
    ACTIONS, ActionRequest, CANCEL_FLIGHT_INFO, DeleteRequest, GrantRequest, INVOKE, LeaseRequest,
    LeasesRequest, ObjectsRequest, PUT_ATTACHMENT, PUT_MODULE, RENEW_FLIGHT_ENDPOINT, RefsRequest,
    ReleaseLeaseRequest, ReleaseRequest, ScrubRequest, StatsRequest, TouchLeaseRequest,
};

impl FlightNode {
    /// The answer to `action` by `who`.
    pub(super) async fn action(
        &self,
        who: &Principal,
        action: Action,
    ) -> Result<arrow_flight::Result> {
        let body = action.body;
        match action.r#type.as_str() {
            StatsRequest::TYPE => self.stats(who, StatsRequest::decode(&body)?).await,
            ScrubRequest::TYPE => self.scrub(who, ScrubRequest::decode(&body)?).await,
            DeleteRequest::TYPE => self.delete(who, DeleteRequest::decode(&body)?).await,
            ObjectsRequest::TYPE => self.objects(who, ObjectsRequest::decode(&body)?),
            PUT_MODULE => self.put_module(who, body).await,
            PUT_ATTACHMENT => self.put_attachment(who, body).await,
            RENEW_FLIGHT_ENDPOINT => self.renew(who, &body).await,
            CANCEL_FLIGHT_INFO => self.cancel(who, &body).await,
            ReleaseRequest::TYPE => self.release(who, ReleaseRequest::decode(&body)?).await,
            RefsRequest::TYPE => self.refs(who, RefsRequest::decode(&body)?),
            GrantRequest::TYPE => self.grant(who, GrantRequest::decode(&body)?).await,
            LeaseRequest::TYPE => self.lease(who, LeaseRequest::decode(&body)?),
            ReleaseLeaseRequest::TYPE => {
                self.release_lease(who, ReleaseLeaseRequest::decode(&body)?)
            }
            TouchLeaseRequest::TYPE => self.touch_lease(who, TouchLeaseRequest::decode(&body)?),
            LeasesRequest::TYPE => self.leases(who, LeasesRequest::decode(&body)?),
            INVOKE => self.invoke(who, body).await,
            other => {
                let known: Vec<&str> = ACTIONS.iter().map(|(t, _)| *t).collect();
                Err(Error::InvalidArgument(format!(
                    "unknown action {:?}: this node knows {}",
                    truncated(other),
                    known.join(", ")
                )))
            }
        }
    }
}
