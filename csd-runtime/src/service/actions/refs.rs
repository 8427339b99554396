//! The actions on kept results: Flight's `RenewFlightEndpoint` and
//! `CancelFlightInfo` (protobuf bodies), and csd's `release`, `refs` and `grant`.
//! Only a kept result's owner (or an admin) renews, releases or grants it.

use arrow_flight::{
    CancelFlightInfoRequest, CancelFlightInfoResult, CancelStatus, RenewFlightEndpointRequest,
};
use prost::Message as _;

use super::super::{FlightNode, json_result};
use crate::auth::Principal;
use crate::error::{Error, Result, truncated};
use crate::protocol::actions::{GrantRequest, RefDescription, RefsRequest, ReleaseRequest};
use crate::refs::{now_unix_ms, timestamp};

impl FlightNode {
    /// `RenewFlightEndpoint`: a kept result's new expiry (its ticket names it).
    pub(super) async fn renew(&self, who: &Principal, body: &[u8]) -> Result<arrow_flight::Result> {
        let r = RenewFlightEndpointRequest::decode(body).map_err(|e| {
            Error::external(
                crate::StatusCode::InvalidArgument,
                "malformed RenewFlightEndpointRequest",
                e,
            )
        })?;
        let endpoint = r.endpoint.ok_or_else(|| {
            Error::InvalidArgument("RenewFlightEndpoint names no endpoint".into())
        })?;
        let ticket = endpoint
            .ticket
            .as_ref()
            .map(|t| t.ticket.clone())
            .unwrap_or_default();
        let id = self.ref_of(who, &ticket)?;
        let expires = match endpoint.expiration_time {
            Some(t) => unix_ms_of(&t)?,
            None => now_unix_ms().saturating_add(self.state.refs.max_ttl.as_millis() as u64),
        };
        let renewed = self
            .state
            .refs
            .renew(&id, Self::ref_owner(who), expires)
            .await?;
        let mut out = endpoint.clone();
        out.expiration_time = Some(timestamp(renewed.expires_unix_ms));
        Ok(arrow_flight::Result {
            body: out.encode_to_vec().into(),
        })
    }

    /// `CancelFlightInfo`: frees the kept results whose tickets a `FlightInfo` holds.
    pub(super) async fn cancel(
        &self,
        who: &Principal,
        body: &[u8],
    ) -> Result<arrow_flight::Result> {
        let r = CancelFlightInfoRequest::decode(body).map_err(|e| {
            Error::external(
                crate::StatusCode::InvalidArgument,
                "malformed CancelFlightInfoRequest",
                e,
            )
        })?;
        let info = r
            .info
            .ok_or_else(|| Error::InvalidArgument("CancelFlightInfo names no FlightInfo".into()))?;
        let mut released = 0;
        for e in &info.endpoint {
            let ticket = e
                .ticket
                .as_ref()
                .map(|t| t.ticket.clone())
                .unwrap_or_default();
            if let Ok(id) = self.ref_of(who, &ticket) {
                self.state
                    .refs
                    .release(&self.state.node.tables, &id, Self::ref_owner(who))
                    .await?;
                released += 1;
            }
        }
        let status = if released > 0 {
            CancelStatus::Cancelled
        } else {
            CancelStatus::NotCancellable
        };
        Ok(arrow_flight::Result {
            body: CancelFlightInfoResult::new(status).encode_to_vec().into(),
        })
    }

    /// `release`: frees one kept result now.
    pub(super) async fn release(
        &self,
        who: &Principal,
        r: ReleaseRequest,
    ) -> Result<arrow_flight::Result> {
        let id = self.ref_of(who, &r.ticket_bytes()?)?;
        json_result(
            &self
                .state
                .refs
                .release(&self.state.node.tables, &id, Self::ref_owner(who))
                .await?,
        )
    }

    /// `refs`: the caller's kept results (all of them, for an admin), with tickets.
    pub(super) fn refs(&self, who: &Principal, _: RefsRequest) -> Result<arrow_flight::Result> {
        let owner = Self::ref_owner(who);
        let list: Vec<RefDescription> = self
            .state
            .refs
            .list(owner)
            .iter()
            .map(|r| self.ref_description(owner.unwrap_or(&r.tenant), r))
            .collect();
        json_result(&list)
    }

    /// `grant`: another tenant of this node may read the kept query (or, with
    /// `revoke`, no longer).
    pub(super) async fn grant(
        &self,
        who: &Principal,
        r: GrantRequest,
    ) -> Result<arrow_flight::Result> {
        let id = self.ref_of(who, &r.ticket_bytes()?)?;
        if self.state.auth.enabled() && !self.state.auth.knows(&r.tenant) {
            return Err(Error::InvalidArgument(format!(
                "no tenant named {:?} at this node: a kept result is granted to a tenant of its tenants file",
                truncated(&r.tenant)
            )));
        }
        let info = self
            .state
            .refs
            .grant(&id, Self::ref_owner(who), &r.tenant, r.revoke)
            .await?;
        tracing::info!(reference = %info.id, to = %r.tenant, revoke = r.revoke, "grant");
        json_result(&self.ref_description(&r.tenant, &info))
    }
}

/// A protobuf timestamp as milliseconds since the Unix epoch (refused before 1970).
fn unix_ms_of(t: &prost_types::Timestamp) -> Result<u64> {
    if t.seconds < 0 || !(0..1_000_000_000).contains(&t.nanos) {
        return Err(Error::InvalidArgument(format!(
            "expiration time {}s {}ns is not a time after 1970",
            t.seconds, t.nanos
        )));
    }
    Ok((t.seconds as u64).saturating_mul(1000) + (t.nanos as u64) / 1_000_000)
}
