//! The Arrow Flight service of a storage node.
//!
//! | RPC | what it does | where |
//! |---|---|---|
//! | `DoPut` | descriptor path `[table]` or `[table, partition]` (default partition `0`): stores the Arrow stream as one new Parquet object; answers a `PutResult` whose metadata is the JSON [`PutSummary`](crate::protocol::PutSummary) | `put.rs` |
//! | `ListFlights` | one `FlightInfo` per table (criteria expression: optional name prefix): schema, rows, bytes, one endpoint per partition with its scan ticket; `app_metadata` is JSON [`TableDescription`](crate::protocol::TableDescription) | `describe.rs` |
//! | `GetFlightInfo` / `GetSchema` | the same for one table (descriptor path `[table]`); with a command, an operator ticket whose answer the node keeps | `describe.rs`, `keep.rs` |
//! | `DoGet` | a [`Ticket`](crate::protocol::Ticket): `Scan` streams Arrow batches; `Range` streams raw object bytes in `data_body` chunks; `Ref` streams a kept result; `Operator` runs a registered [`Operator`](crate::operator::Operator) and streams its batches, then an [`OperatorReport`](crate::protocol::OperatorReport) | `get.rs`, `scan.rs`, `operator.rs` |
//! | `DoAction` | the actions of [`crate::protocol::actions`], one handler each | `actions/` |
//! | `Handshake` | Flight's token handshake | here |
//!
//! Every RPC first asks [`FlightNode::who`] the request is (its token or client
//! certificate when the node has tenants, else the tenant it names) and checks the
//! permission (`access.rs`) before touching anything. Errors become gRPC statuses
//! only through [`Error::to_status`].

mod access;
mod actions;
mod answer_codec;
mod describe;
mod get;
mod keep;
mod operator;
mod put;
mod put_copy;
mod scan;
mod stream;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use arrow_flight::flight_service_server::FlightService;
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaResult, Ticket as FlightTicket,
};
use futures::StreamExt;
use futures::stream::BoxStream;
use serde::Serialize;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status, Streaming};

use crate::auth::{AUTHORIZATION, Credential, Principal};
use crate::error::{Error, Result};
use crate::protocol::actions::ACTIONS;
use crate::protocol::{LeaseIds, TENANT_METADATA};
use crate::state::NodeState;

/// The Flight service.
#[derive(Clone)]
pub(crate) struct FlightNode {
    state: Arc<NodeState>,
}

impl FlightNode {
    /// Serves `state`.
    pub(crate) fn new(state: Arc<NodeState>) -> Self {
        FlightNode { state }
    }

    /// Who `request` is: the tenant its token (or client certificate) proves when
    /// the node has tenants, else the one it names.
    fn who<T>(&self, request: &Request<T>) -> Result<Principal> {
        let meta = request.metadata();
        let auth = &self.state.auth;
        if !auth.enabled() {
            return auth.principal(None, None, &tenant_of(meta)?);
        }
        let certs = request.peer_certs();
        let cert = certs.as_ref().and_then(|c| c.first()).map(|c| c.as_ref());
        auth.principal(meta.get(AUTHORIZATION).map(|v| v.as_bytes()), cert, "")
    }
}

/// The tenant a request names: up to 64 of `[A-Za-z0-9_.-]`.
fn tenant_of(meta: &MetadataMap) -> Result<String> {
    let Some(v) = meta.get(TENANT_METADATA) else {
        return Ok(crate::admission::DEFAULT_TENANT.into());
    };
    let t = v.to_str().unwrap_or("");
    let ok = !t.is_empty()
        && t.len() <= 64
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
    if !ok {
        return Err(Error::InvalidArgument(format!(
            "{TENANT_METADATA} must be 1 to 64 letters, digits, '_', '.' or '-'"
        )));
    }
    Ok(t.to_string())
}

/// The `csd-lease` header of a request (lease ids, comma-separated), if any,
/// checked once: an id that is not one is `INVALID_ARGUMENT`.
fn lease_header(m: &MetadataMap) -> Result<Option<LeaseIds>> {
    let Some(v) = m.get(crate::protocol::LEASE_METADATA) else {
        return Ok(None);
    };
    let v = v.to_str().map_err(|_| {
        Error::InvalidArgument(format!(
            "{} must be lease ids in ASCII, comma-separated",
            crate::protocol::LEASE_METADATA
        ))
    })?;
    LeaseIds::parse(v)
}

type FlightStream<T> = BoxStream<'static, Result<T, Status>>;

fn one<T: Send + 'static>(item: T) -> Response<FlightStream<T>> {
    Response::new(futures::stream::once(async move { Ok(item) }).boxed())
}

fn json_result<T: Serialize>(v: &T) -> Result<arrow_flight::Result> {
    let body = serde_json::to_vec_pretty(v)
        .map_err(|e| Error::external(crate::StatusCode::Internal, "encoding an answer", e))?;
    Ok(arrow_flight::Result { body: body.into() })
}

#[tonic::async_trait]
impl FlightService for FlightNode {
    type HandshakeStream = FlightStream<HandshakeResponse>;
    type ListFlightsStream = FlightStream<FlightInfo>;
    type DoGetStream = FlightStream<FlightData>;
    type DoPutStream = FlightStream<PutResult>;
    type DoActionStream = FlightStream<arrow_flight::Result>;
    type ListActionsStream = FlightStream<ActionType>;
    type DoExchangeStream = FlightStream<FlightData>;

    /// Flight's token handshake: `authorization: Basic base64(tenant:token)` (or a
    /// bearer token) in, the bearer token to send with every call out, in the
    /// `authorization` response header. Optional: tokens work without it.
    async fn handshake(
        &self,
        request: Request<Streaming<HandshakeRequest>>,
    ) -> Result<Response<Self::HandshakeStream>, Status> {
        let who = self.who(&request)?;
        let mut response = one(HandshakeResponse::default());
        if who.tenant().is_some() {
            let token = request
                .metadata()
                .get(AUTHORIZATION)
                .map(|v| crate::auth::parse_authorization(v.as_bytes()))
                .transpose()?
                .map(|c| match c {
                    Credential::Bearer(t) => t,
                    Credential::Basic { password, .. } => password,
                });
            if let Some(v) = token.and_then(|t| format!("Bearer {t}").parse().ok()) {
                response.metadata_mut().insert(AUTHORIZATION, v);
            }
        }
        Ok(response)
    }

    async fn list_flights(
        &self,
        request: Request<Criteria>,
    ) -> Result<Response<Self::ListFlightsStream>, Status> {
        let who = self.who(&request)?;
        let infos = self.list(&who, &request.into_inner())?;
        Ok(Response::new(futures::stream::iter(infos).boxed()))
    }

    async fn get_flight_info(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let who = self.who(&request)?;
        if request.get_ref().r#type == arrow_flight::flight_descriptor::DescriptorType::Cmd as i32 {
            let peer = request.remote_addr().map(|a| a.ip());
            let lease = lease_header(request.metadata())?;
            let cmd = request.into_inner().cmd;
            return Ok(Response::new(self.keep(who, peer, &cmd, lease).await?));
        }
        Ok(Response::new(self.describe(&who, request.get_ref())?))
    }

    async fn poll_flight_info(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<PollInfo>, Status> {
        self.who(&request)?;
        Err(
            Error::Unimplemented("PollFlightInfo is not supported: use GetFlightInfo".into())
                .into(),
        )
    }

    async fn get_schema(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<SchemaResult>, Status> {
        let who = self.who(&request)?;
        Ok(Response::new(self.schema(&who, request.get_ref())?))
    }

    async fn do_get(
        &self,
        request: Request<FlightTicket>,
    ) -> Result<Response<Self::DoGetStream>, Status> {
        self.state.counters.do_get.fetch_add(1, Ordering::Relaxed);
        let who = self.who(&request)?;
        Ok(Response::new(self.get(who, &request).await?))
    }

    async fn do_put(
        &self,
        request: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoPutStream>, Status> {
        self.state.counters.do_put.fetch_add(1, Ordering::Relaxed);
        let who = self.who(&request)?;
        let summary = self.put(request.into_inner(), who).await?;
        let meta = serde_json::to_vec(&summary)
            .map_err(|e| Error::external(crate::StatusCode::Internal, "put summary", e))?;
        Ok(one(PutResult {
            app_metadata: meta.into(),
        }))
    }

    async fn do_exchange(
        &self,
        request: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoExchangeStream>, Status> {
        self.who(&request)?;
        Err(Error::Unimplemented("DoExchange is not supported".into()).into())
    }

    async fn do_action(
        &self,
        request: Request<Action>,
    ) -> Result<Response<Self::DoActionStream>, Status> {
        let who = self.who(&request)?;
        Ok(one(self.action(&who, request.into_inner()).await?))
    }

    async fn list_actions(
        &self,
        request: Request<Empty>,
    ) -> Result<Response<Self::ListActionsStream>, Status> {
        self.who(&request)?;
        let actions = ACTIONS.map(|(t, d)| {
            Ok(ActionType {
                r#type: t.into(),
                description: d.into(),
            })
        });
        Ok(Response::new(futures::stream::iter(actions).boxed()))
    }
}
