//! Kept results through a node: keep an operator's answer there, resolve, renew,
//! release and grant it (see [`crate::refs`]).

use std::time::Duration;

use arrow::record_batch::RecordBatch;
use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::error::FlightError;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};

use super::client::NodeClient;
use super::error::{Error, Result};
use super::reply::{OperatorReply, reply_of};
use crate::actions::{GrantRequest, RefDescription, RefsRequest, ReleaseRequest};
use crate::messages::OperatorReport;
use crate::refs::{RefInfo, Reference, now_unix_ms, timestamp};
use crate::ticket::{Compression, Ticket};

impl NodeClient {
    /// Runs operator `name` at the node and keeps its answer there for `ttl` instead
    /// of streaming it (see [`crate::refs`]): a reference any Flight client can
    /// resolve, renew or release. The node queues the request rather than hand it
    /// back for queueing delay (a kept result cannot be finished here). `group`
    /// (see [`crate::refs::new_group`]) keeps it in the same table as the other
    /// parts of one query; `None`: a table of its own.
    pub async fn keep(
        &self,
        name: &str,
        args: Vec<u8>,
        compression: Compression,
        ttl: Duration,
        group: Option<&str>,
    ) -> Result<Kept> {
        let ticket = Ticket::Operator {
            name: name.into(),
            args,
            compression,
            patient: true,
            asker: None,
            keep_ms: Some(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX)),
            keep_group: group.map(String::from),
        };
        let info = self
            .flight()
            .get_flight_info(arrow_flight::FlightDescriptor::new_cmd(ticket.encode()))
            .await?;
        let endpoint = info
            .endpoint
            .first()
            .ok_or_else(|| Error::Protocol("a kept result came back without an endpoint".into()))?;
        Ok(Kept {
            reference: Reference::of_endpoint(endpoint, self.url())
                .map_err(|e| Error::Protocol(e.to_string()))?,
            rows: u64::try_from(info.total_records).unwrap_or(0),
            bytes: u64::try_from(info.total_bytes).unwrap_or(0),
            report: serde_json::from_slice(&info.app_metadata).ok(),
        })
    }

    /// Streams a kept result held by this node (`DoGet` of its ticket).
    pub async fn resolve(
        &self,
        reference: &Reference,
    ) -> Result<BoxStream<'static, Result<RecordBatch>>> {
        let ticket = reference
            .ticket_bytes()
            .map_err(|e| Error::InvalidInput(e.to_string()))?;
        let inner = self.do_get_bytes(ticket).await?;
        let stream = FlightRecordBatchStream::new_from_flight_data(
            inner.map_err(|s| FlightError::Tonic(Box::new(s))),
        );
        Ok(stream.map_err(Error::from).boxed())
    }

    /// Like [`Self::resolve`], with the bytes received counted (as an operator's
    /// answer is).
    pub async fn resolve_counted(&self, reference: &Reference) -> Result<OperatorReply> {
        let ticket = reference
            .ticket_bytes()
            .map_err(|e| Error::InvalidInput(e.to_string()))?;
        Ok(reply_of(self.do_get_bytes(ticket).await?))
    }

    /// Extends a kept result to `ttl` from now (Flight's `RenewFlightEndpoint`).
    pub async fn renew(&self, reference: &Reference, ttl: Duration) -> Result<Reference> {
        let mut endpoint = reference
            .endpoint()
            .map_err(|e| Error::InvalidInput(e.to_string()))?;
        let until = now_unix_ms().saturating_add(ttl.as_millis() as u64);
        endpoint.expiration_time = Some(timestamp(until));
        let renewed = self
            .flight()
            .renew_flight_endpoint(arrow_flight::RenewFlightEndpointRequest {
                endpoint: Some(endpoint),
            })
            .await?;
        Reference::of_endpoint(&renewed, self.url()).map_err(|e| Error::Protocol(e.to_string()))
    }

    /// Frees a kept result now.
    pub async fn release(&self, reference: &Reference) -> Result<RefInfo> {
        self.action(&ReleaseRequest {
            ticket: reference.ticket.clone(),
        })
        .await
    }

    /// Lets tenant `to` read the kept query `reference` belongs to (at this node), or
    /// with `revoke`, no longer; returns the reference as `to` resolves it (its
    /// ticket sealed for `to`).
    pub async fn grant(&self, reference: &Reference, to: &str, revoke: bool) -> Result<Reference> {
        let d = self
            .action(&GrantRequest {
                ticket: reference.ticket.clone(),
                tenant: to.to_string(),
                revoke,
            })
            .await?;
        Ok(d.reference())
    }

    /// This tenant's kept results at the node (all of them, for an admin).
    pub async fn refs(&self) -> Result<Vec<RefDescription>> {
        self.action(&RefsRequest {}).await
    }
}

/// What [`NodeClient::keep`] answers.
#[derive(Debug, Clone)]
pub struct Kept {
    /// The reference (print it as JSON; resolve it from anywhere).
    pub reference: Reference,
    /// Rows kept.
    pub rows: u64,
    /// Bytes it takes at the node.
    pub bytes: u64,
    /// The operator's report of the run.
    pub report: Option<OperatorReport>,
}
