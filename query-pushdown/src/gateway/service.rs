//! The Flight SQL calls (arrow-flight's [`FlightSqlService`]): statements,
//! prepared statements, metadata, the handshake, cancelling. Each call plans with a
//! session of its caller's own over the cluster, as `csd sql` does.

use std::pin::Pin;
use std::sync::Arc;

use arrow::datatypes::{DataType, Schema, SchemaRef};
use arrow::ipc::writer::IpcWriteOptions;
use arrow::record_batch::RecordBatch;
use arrow_flight::decode::{DecodedPayload, FlightDataDecoder};
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_server::FlightService;
use arrow_flight::sql::server::{FlightSqlService, PeekableFlightDataStream};
use arrow_flight::sql::{
    ActionCancelQueryRequest, ActionCancelQueryResult, ActionClosePreparedStatementRequest,
    ActionCreatePreparedStatementRequest, ActionCreatePreparedStatementResult, Any,
    CommandGetCatalogs, CommandGetDbSchemas, CommandGetSqlInfo, CommandGetTableTypes,
    CommandGetTables, CommandGetXdbcTypeInfo, CommandPreparedStatementQuery,
    CommandPreparedStatementUpdate, CommandStatementQuery, CommandStatementUpdate,
    DoPutPreparedStatementResult, ProstMessageExt, SqlInfo, TicketStatementQuery,
};
use arrow_flight::{
    Action, ActionType, CancelFlightInfoRequest, CancelFlightInfoResult, CancelStatus,
    FlightDescriptor, FlightEndpoint, FlightInfo, HandshakeRequest, HandshakeResponse, IpcMessage,
    SchemaAsIpc, Ticket,
};
use csd_protocol::ipc::{check_message, next_decoded};
use csd_protocol::{AUTHORIZATION, ActionRequest, Error, GatewayStatsRequest};
use datafusion::logical_expr::LogicalPlan;
use futures::{Stream, StreamExt, TryStreamExt};
use prost::Message;
use tonic::{Request, Response, Status, Streaming};

use super::auth::Caller;
use super::handle::Statement;
use super::metadata;
use super::params;
use super::state::Gateway;
use super::stats::bump;
use crate::compute::session::CsdSession;
use crate::error::to_runtime;

type DoGetStream = <Gateway as FlightService>::DoGetStream;
type DoActionStream = <Gateway as FlightService>::DoActionStream;

/// The action that cancels a streaming answer (Flight's own, since format 1.x; the
/// Flight SQL `CancelQuery` is its older twin).
pub(crate) const CANCEL_FLIGHT_INFO: &str = "CancelFlightInfo";

/// The schema clients see for `schema`: string and binary views as plain strings
/// and binary, dictionaries as their values. A view column of a small answer (a
/// top-k, a filter) still points into every buffer it was cut from, and IPC sends
/// whole buffers: TPC-H Q10's 20 rows were 52 MB as views. Plain types also reach
/// clients whose Arrow predates views.
pub(crate) fn wire_schema(schema: &Schema) -> Result<SchemaRef, Error> {
    let plain = Schema::new_with_metadata(
        schema
            .fields()
            .iter()
            .map(|f| match f.data_type() {
                DataType::Utf8View => f.as_ref().clone().with_data_type(DataType::Utf8),
                DataType::BinaryView => f.as_ref().clone().with_data_type(DataType::Binary),
                _ => f.as_ref().clone(),
            })
            .collect::<Vec<_>>(),
        schema.metadata().clone(),
    );
    FlightDataEncoderBuilder::new()
        .with_schema(Arc::new(plain))
        .build(futures::stream::empty())
        .known_schema()
        .ok_or_else(|| Error::Internal("the encoder knows no schema".into()))
}

/// `batch` as `wire` declares it: columns cast where their type differs (views,
/// dictionaries), the advertised nullability checked.
fn to_wire(batch: &RecordBatch, wire: &SchemaRef) -> Result<RecordBatch, arrow::error::ArrowError> {
    let columns = batch
        .columns()
        .iter()
        .zip(wire.fields())
        .map(|(c, f)| {
            if c.data_type() == f.data_type() {
                Ok(c.clone())
            } else {
                arrow::compute::cast(c, f.data_type())
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    RecordBatch::try_new(wire.clone(), columns)
}

fn ipc_schema(schema: &Schema) -> Result<bytes::Bytes, Error> {
    let m: IpcMessage = SchemaAsIpc::new(schema, &IpcWriteOptions::default())
        .try_into()
        .map_err(|e| Error::external(csd_protocol::StatusCode::Internal, "encoding a schema", e))?;
    Ok(m.0)
}

/// One batch as a `DoGet` answer.
fn one_batch(schema: SchemaRef, batch: RecordBatch) -> DoGetStream {
    FlightDataEncoderBuilder::new()
        .with_schema(schema)
        .build(futures::stream::once(async move { Ok(batch) }))
        .map_err(Status::from)
        .boxed()
}

fn read_only() -> Status {
    Error::Unimplemented(
        "the gateway answers queries only: updates are not served (store tables with `csd put`)"
            .into(),
    )
    .into()
}

/// A `FlightInfo` whose one endpoint's ticket is `ticket`.
fn info(
    schema: &Schema,
    ticket: Vec<u8>,
    descriptor: FlightDescriptor,
) -> Result<FlightInfo, Status> {
    Ok(FlightInfo::new()
        .try_with_schema(schema)
        .map_err(|e| {
            Status::from(Error::external(
                csd_protocol::StatusCode::Internal,
                "encoding a schema",
                e,
            ))
        })?
        .with_endpoint(FlightEndpoint::new().with_ticket(Ticket::new(ticket)))
        .with_descriptor(descriptor)
        .with_total_records(-1))
}

impl Gateway {
    /// `statement`'s plan in a session of `caller`'s, and the schema clients see.
    pub(crate) async fn plan(
        &self,
        caller: &Caller,
        statement: &Statement,
    ) -> Result<(Arc<CsdSession>, LogicalPlan, SchemaRef), Error> {
        let session = self.session(caller).await?;
        let plan = params::plan(&session.ctx, statement).await?;
        let schema = wire_schema(plan.schema().as_arrow())?;
        Ok((session, plan, schema))
    }

    async fn statement_info(
        &self,
        statement: Statement,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let caller = self.caller(request.metadata())?;
        let (_, _, schema) = self.plan(&caller, &statement).await?;
        bump(&self.counters.statements);
        let ticket = TicketStatementQuery {
            statement_handle: statement.encode()?,
        }
        .as_any()
        .encode_to_vec();
        Ok(Response::new(info(&schema, ticket, request.into_inner())?))
    }

    /// A metadata command's `FlightInfo`: the command itself is the ticket.
    fn metadata_info(
        &self,
        command: impl ProstMessageExt,
        schema: &Schema,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.caller(request.metadata())?;
        Ok(Response::new(info(
            schema,
            command.as_any().encode_to_vec(),
            request.into_inner(),
        )?))
    }

    fn cancel(&self, info: &FlightInfo) -> usize {
        info.endpoint
            .iter()
            .filter_map(|e| e.ticket.as_ref())
            .map(|t| self.running.cancel(&t.ticket))
            .sum()
    }
}

#[tonic::async_trait]
impl FlightSqlService for Gateway {
    type FlightService = Gateway;

    async fn do_handshake(
        &self,
        request: Request<Streaming<HandshakeRequest>>,
    ) -> Result<
        Response<Pin<Box<dyn Stream<Item = Result<HandshakeResponse, Status>> + Send>>>,
        Status,
    > {
        let caller = self.caller(request.metadata())?;
        // The nodes accept the token now (else UNAUTHENTICATED here, not at the
        // first query); the session is the first query's.
        self.new_session(&caller).await?;
        bump(&self.counters.handshakes);
        let answer = HandshakeResponse {
            protocol_version: 0,
            payload: caller.token.clone().unwrap_or_default().into_bytes().into(),
        };
        let mut response: Response<Pin<Box<dyn Stream<Item = _> + Send>>> =
            Response::new(Box::pin(futures::stream::iter([Ok(answer)])));
        if let Some(b) = caller.bearer().and_then(|b| b.parse().ok()) {
            response.metadata_mut().insert(AUTHORIZATION, b);
        }
        Ok(response)
    }

    async fn get_flight_info_statement(
        &self,
        query: CommandStatementQuery,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        if query.transaction_id.is_some() {
            return Err(Error::Unimplemented("the gateway has no transactions".into()).into());
        }
        self.statement_info(Statement::new(query.query), request)
            .await
    }

    async fn get_flight_info_prepared_statement(
        &self,
        cmd: CommandPreparedStatementQuery,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let statement = Statement::decode(&cmd.prepared_statement_handle)?;
        self.statement_info(statement, request).await
    }

    async fn do_get_statement(
        &self,
        ticket: TicketStatementQuery,
        request: Request<Ticket>,
    ) -> Result<Response<DoGetStream>, Status> {
        let caller = self.caller(request.metadata())?;
        let statement = Statement::decode(&ticket.statement_handle)?;
        let (session, plan, schema) = self.plan(&caller, &statement).await?;
        let stream = session
            .ctx
            .execute_logical_plan(plan)
            .await
            .map_err(to_runtime)?
            .execute_stream()
            .await
            .map_err(to_runtime)?;
        // Batches carry the schema as advertised (nullability included: clients
        // compare), and the session lives as long as its answer.
        let wire = schema.clone();
        let batches = stream.map(move |b| {
            let _session = &session;
            let b = b.map_err(|e| FlightError::Tonic(Box::new(to_runtime(e).into())))?;
            to_wire(&b, &wire).map_err(FlightError::Arrow)
        });
        let watched =
            self.running
                .watch(request.into_inner().ticket, batches, self.counters.clone());
        Ok(Response::new(
            FlightDataEncoderBuilder::new()
                .with_schema(schema)
                .build(watched)
                .map_err(Status::from)
                .boxed(),
        ))
    }

    async fn do_get_prepared_statement(
        &self,
        query: CommandPreparedStatementQuery,
        request: Request<Ticket>,
    ) -> Result<Response<DoGetStream>, Status> {
        // Clients that use the command as the ticket get the same answer.
        let ticket = TicketStatementQuery {
            statement_handle: query.prepared_statement_handle,
        };
        self.do_get_statement(ticket, request).await
    }

    async fn do_action_create_prepared_statement(
        &self,
        query: ActionCreatePreparedStatementRequest,
        request: Request<Action>,
    ) -> Result<ActionCreatePreparedStatementResult, Status> {
        if query.transaction_id.is_some() {
            return Err(Error::Unimplemented("the gateway has no transactions".into()).into());
        }
        let caller = self.caller(request.metadata())?;
        let statement = Statement::new(query.query);
        let (_, plan, schema) = self.plan(&caller, &statement).await?;
        let parameters = params::parameter_schema(&plan)?;
        bump(&self.counters.prepared);
        Ok(ActionCreatePreparedStatementResult {
            prepared_statement_handle: statement.encode()?,
            dataset_schema: ipc_schema(&schema)?,
            parameter_schema: ipc_schema(&parameters)?,
        })
    }

    async fn do_put_prepared_statement_query(
        &self,
        query: CommandPreparedStatementQuery,
        request: Request<PeekableFlightDataStream>,
    ) -> Result<DoPutPreparedStatementResult, Status> {
        self.caller(request.metadata())?;
        let mut statement = Statement::decode(&query.prepared_statement_handle)?;
        let checked = request.into_inner().map(|m| {
            let m = m.map_err(FlightError::from)?;
            check_message(&m).map_err(|e| FlightError::ExternalError(Box::new(e)))?;
            Ok(m)
        });
        let mut decoder = FlightDataDecoder::new(checked);
        let mut batches = Vec::new();
        let mut rows = 0;
        while let Some(d) = next_decoded(&mut decoder).await {
            if let DecodedPayload::RecordBatch(b) = d?.payload {
                rows += b.num_rows();
                batches.push(b);
                if rows > 1 {
                    break;
                }
            }
        }
        let values = params::values_of(&batches)?;
        statement.params = (!values.is_empty()).then_some(values);
        Ok(DoPutPreparedStatementResult {
            prepared_statement_handle: Some(statement.encode()?),
        })
    }

    async fn do_put_statement_update(
        &self,
        _: CommandStatementUpdate,
        _: Request<PeekableFlightDataStream>,
    ) -> Result<i64, Status> {
        Err(read_only())
    }

    async fn do_put_prepared_statement_update(
        &self,
        _: CommandPreparedStatementUpdate,
        _: Request<PeekableFlightDataStream>,
    ) -> Result<i64, Status> {
        Err(read_only())
    }

    async fn do_action_close_prepared_statement(
        &self,
        query: ActionClosePreparedStatementRequest,
        request: Request<Action>,
    ) -> Result<(), Status> {
        self.caller(request.metadata())?;
        // Handles are stateless: nothing to let go of, but a handle that is none of
        // ours is still an error.
        Statement::decode(&query.prepared_statement_handle)?;
        Ok(())
    }

    async fn get_flight_info_catalogs(
        &self,
        query: CommandGetCatalogs,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let schema = query.into_builder().schema();
        self.metadata_info(query, &schema, request)
    }

    async fn do_get_catalogs(
        &self,
        query: CommandGetCatalogs,
        request: Request<Ticket>,
    ) -> Result<Response<DoGetStream>, Status> {
        let session = self.session(&self.caller(request.metadata())?).await?;
        let batch = metadata::catalogs(&session.ctx, query)?;
        Ok(Response::new(one_batch(batch.schema(), batch)))
    }

    async fn get_flight_info_schemas(
        &self,
        query: CommandGetDbSchemas,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let schema = query.clone().into_builder().schema();
        self.metadata_info(query, &schema, request)
    }

    async fn do_get_schemas(
        &self,
        query: CommandGetDbSchemas,
        request: Request<Ticket>,
    ) -> Result<Response<DoGetStream>, Status> {
        let session = self.session(&self.caller(request.metadata())?).await?;
        let batch = metadata::db_schemas(&session.ctx, query)?;
        Ok(Response::new(one_batch(batch.schema(), batch)))
    }

    async fn get_flight_info_tables(
        &self,
        query: CommandGetTables,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let schema = query.clone().into_builder().schema();
        self.metadata_info(query, &schema, request)
    }

    async fn do_get_tables(
        &self,
        query: CommandGetTables,
        request: Request<Ticket>,
    ) -> Result<Response<DoGetStream>, Status> {
        let session = self.session(&self.caller(request.metadata())?).await?;
        let batch = metadata::tables(&session.ctx, query).await?;
        Ok(Response::new(one_batch(batch.schema(), batch)))
    }

    async fn get_flight_info_table_types(
        &self,
        query: CommandGetTableTypes,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let schema = query.into_builder().schema();
        self.metadata_info(query, &schema, request)
    }

    async fn do_get_table_types(
        &self,
        query: CommandGetTableTypes,
        request: Request<Ticket>,
    ) -> Result<Response<DoGetStream>, Status> {
        self.caller(request.metadata())?;
        let batch = metadata::table_types(query)?;
        Ok(Response::new(one_batch(batch.schema(), batch)))
    }

    async fn get_flight_info_sql_info(
        &self,
        query: CommandGetSqlInfo,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let schema = query.clone().into_builder(metadata::sql_info()?).schema();
        self.metadata_info(query, &schema, request)
    }

    async fn do_get_sql_info(
        &self,
        query: CommandGetSqlInfo,
        request: Request<Ticket>,
    ) -> Result<Response<DoGetStream>, Status> {
        self.caller(request.metadata())?;
        let batch = query
            .into_builder(metadata::sql_info()?)
            .build()
            .map_err(|e| Error::external(csd_protocol::StatusCode::Internal, "SqlInfo", e))?;
        Ok(Response::new(one_batch(batch.schema(), batch)))
    }

    async fn get_flight_info_xdbc_type_info(
        &self,
        query: CommandGetXdbcTypeInfo,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let schema = query.into_builder(metadata::xdbc_info()?).schema();
        self.metadata_info(query, &schema, request)
    }

    async fn do_get_xdbc_type_info(
        &self,
        query: CommandGetXdbcTypeInfo,
        request: Request<Ticket>,
    ) -> Result<Response<DoGetStream>, Status> {
        self.caller(request.metadata())?;
        let batch = query
            .into_builder(metadata::xdbc_info()?)
            .build()
            .map_err(|e| Error::external(csd_protocol::StatusCode::Internal, "XdbcTypeInfo", e))?;
        Ok(Response::new(one_batch(batch.schema(), batch)))
    }

    async fn do_action_cancel_query(
        &self,
        query: ActionCancelQueryRequest,
        request: Request<Action>,
    ) -> Result<ActionCancelQueryResult, Status> {
        self.caller(request.metadata())?;
        let info = FlightInfo::decode(query.info)
            .map_err(|e| Error::InvalidArgument(format!("CancelQuery: not a FlightInfo ({e})")))?;
        // `CancelResult` (not re-exported by arrow-flight): 1 cancelled, 3 not
        // cancellable.
        let result = if self.cancel(&info) > 0 { 1 } else { 3 };
        Ok(ActionCancelQueryResult { result })
    }

    async fn do_action_fallback(
        &self,
        request: Request<Action>,
    ) -> Result<Response<DoActionStream>, Status> {
        self.caller(request.metadata())?;
        let action = request.into_inner();
        let body = match action.r#type.as_str() {
            CANCEL_FLIGHT_INFO => {
                let req = CancelFlightInfoRequest::decode(action.body).map_err(|e| {
                    Error::InvalidArgument(format!(
                        "CancelFlightInfo: not a CancelFlightInfoRequest ({e})"
                    ))
                })?;
                let info = req.info.ok_or_else(|| {
                    Error::InvalidArgument("CancelFlightInfo names no FlightInfo".into())
                })?;
                let status = if self.cancel(&info) > 0 {
                    CancelStatus::Cancelled
                } else {
                    CancelStatus::NotCancellable
                };
                CancelFlightInfoResult::new(status).encode_to_vec()
            }
            GatewayStatsRequest::TYPE => serde_json::to_vec(&self.counters.snapshot())
                .map_err(|e| Error::external(csd_protocol::StatusCode::Internal, "stats", e))?,
            other => {
                return Err(Error::Unimplemented(format!(
                    "action {:?}: the gateway serves Flight SQL's actions, {CANCEL_FLIGHT_INFO} and {}",
                    csd_protocol::error::truncated(other),
                    GatewayStatsRequest::TYPE
                ))
                .into());
            }
        };
        let result = arrow_flight::Result { body: body.into() };
        Ok(Response::new(futures::stream::iter([Ok(result)]).boxed()))
    }

    async fn list_custom_actions(&self) -> Option<Vec<Result<ActionType, Status>>> {
        Some(vec![
            Ok(ActionType {
                r#type: CANCEL_FLIGHT_INFO.into(),
                description: "stop a query's answer (body: CancelFlightInfoRequest)".into(),
            }),
            Ok(ActionType {
                r#type: GatewayStatsRequest::TYPE.into(),
                description: GatewayStatsRequest::DESCRIPTION.into(),
            }),
        ])
    }

    async fn register_sql_info(&self, _id: i32, _result: &SqlInfo) {}
}

/// The schema a `GetSchema` of `command` answers (statements planned for `caller`).
pub(crate) async fn schema_of(
    gateway: &Gateway,
    caller: &Caller,
    command: Any,
) -> Result<SchemaRef, Error> {
    use arrow_flight::sql::Command;
    let command = Command::try_from(command).map_err(|e| {
        Error::InvalidArgument(format!("GetSchema: not a Flight SQL command ({e})"))
    })?;
    let statement = match command {
        Command::CommandStatementQuery(q) => Statement::new(q.query),
        Command::CommandPreparedStatementQuery(q) => {
            Statement::decode(&q.prepared_statement_handle)?
        }
        Command::CommandGetCatalogs(q) => return Ok(q.into_builder().schema()),
        Command::CommandGetDbSchemas(q) => return Ok(q.into_builder().schema()),
        Command::CommandGetTables(q) => return Ok(q.into_builder().schema()),
        Command::CommandGetTableTypes(q) => return Ok(q.into_builder().schema()),
        Command::CommandGetSqlInfo(q) => return Ok(q.into_builder(metadata::sql_info()?).schema()),
        Command::CommandGetXdbcTypeInfo(q) => {
            return Ok(q.into_builder(metadata::xdbc_info()?).schema());
        }
        other => {
            return Err(Error::Unimplemented(format!(
                "GetSchema of {}",
                csd_protocol::error::truncated(other.type_url())
            )));
        }
    };
    let (_, _, schema) = gateway.plan(caller, &statement).await?;
    Ok(schema)
}
