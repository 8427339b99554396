//! The gateway's Flight service: arrow-flight's Flight SQL dispatch, plus what that
//! dispatch cannot do — `GetSchema` (its blanket implementation answers
//! `UNIMPLEMENTED` with no hook) and a clear `INVALID_ARGUMENT` for a command or
//! ticket that does not decode (where the dispatch would answer `INTERNAL`).

use std::sync::Arc;

use arrow::ipc::writer::IpcWriteOptions;
use arrow_flight::flight_service_server::{FlightService, FlightServiceServer};
use arrow_flight::sql::{Any, Command};
use arrow_flight::{
    Action, Criteria, Empty, FlightData, FlightDescriptor, FlightInfo, HandshakeRequest, PollInfo,
    SchemaAsIpc, SchemaResult, Ticket,
};
use csd_protocol::Error;
use prost::Message;
use tonic::{Request, Response, Status, Streaming};

use super::service::schema_of;
use super::state::Gateway;

/// The service (see the module docs).
#[derive(Clone)]
pub(crate) struct GatewayServer(pub(crate) Arc<Gateway>);

impl GatewayServer {
    pub(crate) fn into_server(self) -> FlightServiceServer<Self> {
        FlightServiceServer::new(self)
            .max_decoding_message_size(csd_protocol::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(csd_protocol::MAX_MESSAGE_BYTES)
    }
}

/// `bytes` as a Flight SQL command, or why not.
fn command(bytes: &[u8], what: &str) -> Result<Any, Status> {
    let any = Any::decode(bytes).map_err(|e| {
        Error::InvalidArgument(format!("the {what} is not a Flight SQL command ({e})"))
    })?;
    Command::try_from(any.clone()).map_err(|e| {
        Error::InvalidArgument(format!(
            "the {what} does not decode as {} ({e})",
            csd_protocol::error::truncated(&any.type_url)
        ))
    })?;
    Ok(any)
}

#[tonic::async_trait]
impl FlightService for GatewayServer {
    type HandshakeStream = <Gateway as FlightService>::HandshakeStream;
    type ListFlightsStream = <Gateway as FlightService>::ListFlightsStream;
    type DoGetStream = <Gateway as FlightService>::DoGetStream;
    type DoPutStream = <Gateway as FlightService>::DoPutStream;
    type DoActionStream = <Gateway as FlightService>::DoActionStream;
    type ListActionsStream = <Gateway as FlightService>::ListActionsStream;
    type DoExchangeStream = <Gateway as FlightService>::DoExchangeStream;

    async fn handshake(
        &self,
        request: Request<Streaming<HandshakeRequest>>,
    ) -> Result<Response<Self::HandshakeStream>, Status> {
        FlightService::handshake(&*self.0, request).await
    }

    async fn list_flights(
        &self,
        _request: Request<Criteria>,
    ) -> Result<Response<Self::ListFlightsStream>, Status> {
        Err(
            Error::Unimplemented("ListFlights: list tables with Flight SQL's GetTables".into())
                .into(),
        )
    }

    async fn get_flight_info(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        command(&request.get_ref().cmd, "descriptor")?;
        FlightService::get_flight_info(&*self.0, request).await
    }

    async fn poll_flight_info(
        &self,
        _request: Request<FlightDescriptor>,
    ) -> Result<Response<PollInfo>, Status> {
        Err(Error::Unimplemented("PollFlightInfo: use GetFlightInfo".into()).into())
    }

    async fn get_schema(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<SchemaResult>, Status> {
        let caller = self.0.caller(request.metadata())?;
        let any = command(&request.get_ref().cmd, "descriptor")?;
        let schema = schema_of(&self.0, &caller, any).await?;
        let result: SchemaResult = SchemaAsIpc::new(&schema, &IpcWriteOptions::default())
            .try_into()
            .map_err(|e| {
                Error::external(csd_protocol::StatusCode::Internal, "encoding a schema", e)
            })?;
        Ok(Response::new(result))
    }

    async fn do_get(
        &self,
        request: Request<Ticket>,
    ) -> Result<Response<Self::DoGetStream>, Status> {
        command(&request.get_ref().ticket, "ticket")?;
        FlightService::do_get(&*self.0, request).await
    }

    async fn do_put(
        &self,
        request: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoPutStream>, Status> {
        FlightService::do_put(&*self.0, request).await
    }

    async fn do_exchange(
        &self,
        _request: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoExchangeStream>, Status> {
        Err(Error::Unimplemented("DoExchange: the gateway answers queries".into()).into())
    }

    async fn do_action(
        &self,
        request: Request<Action>,
    ) -> Result<Response<Self::DoActionStream>, Status> {
        FlightService::do_action(&*self.0, request).await
    }

    async fn list_actions(
        &self,
        request: Request<Empty>,
    ) -> Result<Response<Self::ListActionsStream>, Status> {
        FlightService::list_actions(&*self.0, request).await
    }
}
