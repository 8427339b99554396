//! A worker's own Flight service, beside datafusion-distributed's on the same port:
//! what csd's workers exchange besides plans and batches. Actions (protobuf bodies):
//!
//! - `csd.keys.publish`, `csd.keys.fetch`: join-key sets across stages (see
//!   [`super::keys`]);
//! - `csd.module.put`: a session's Wasm module, before its queries call the module's
//!   SQL functions on this worker (the worker compiles it once into its sandbox; a
//!   task's session then registers the functions the coordinator names in
//!   `csd.wasm_functions`).
//!
//! Like the worker service itself it trusts whoever reaches the port.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::flight_service_server::{FlightService, FlightServiceServer};
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaResult, Ticket,
};
use futures::StreamExt;
use futures::stream::BoxStream;
use prost::Message;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status, Streaming};

use super::keys::{FETCH, FetchMsg, KeyBoard, MAX_MESSAGE, PUBLISH, PublishMsg};
use crate::compute::wasm::local_sandbox;

/// The action a coordinator sends a session's Wasm module with.
pub(crate) const PUT_MODULE: &str = "csd.module.put";

/// A client's allowance beyond the time it expects the worker to take.
const CALL_SLACK: Duration = Duration::from_secs(10);

/// The service (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct WorkerActions(pub(crate) Arc<KeyBoard>);

impl WorkerActions {
    pub(crate) fn into_server(self) -> FlightServiceServer<Self> {
        FlightServiceServer::new(self)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE)
    }
}

type FlightStream<T> = BoxStream<'static, Result<T, Status>>;

fn only_actions<T>() -> Result<T, Status> {
    Err(Status::unimplemented(format!(
        "this is a csd worker's own service: it serves the actions {PUBLISH}, {FETCH} and {PUT_MODULE} only"
    )))
}

#[tonic::async_trait]
impl FlightService for WorkerActions {
    type HandshakeStream = FlightStream<HandshakeResponse>;
    type ListFlightsStream = FlightStream<FlightInfo>;
    type DoGetStream = FlightStream<FlightData>;
    type DoPutStream = FlightStream<PutResult>;
    type DoActionStream = FlightStream<arrow_flight::Result>;
    type ListActionsStream = FlightStream<ActionType>;
    type DoExchangeStream = FlightStream<FlightData>;

    async fn handshake(
        &self,
        _: Request<Streaming<HandshakeRequest>>,
    ) -> Result<Response<Self::HandshakeStream>, Status> {
        only_actions()
    }

    async fn list_flights(
        &self,
        _: Request<Criteria>,
    ) -> Result<Response<Self::ListFlightsStream>, Status> {
        only_actions()
    }

    async fn get_flight_info(
        &self,
        _: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        only_actions()
    }

    async fn poll_flight_info(
        &self,
        _: Request<FlightDescriptor>,
    ) -> Result<Response<PollInfo>, Status> {
        only_actions()
    }

    async fn get_schema(
        &self,
        _: Request<FlightDescriptor>,
    ) -> Result<Response<SchemaResult>, Status> {
        only_actions()
    }

    async fn do_get(&self, _: Request<Ticket>) -> Result<Response<Self::DoGetStream>, Status> {
        only_actions()
    }

    async fn do_put(
        &self,
        _: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoPutStream>, Status> {
        only_actions()
    }

    async fn do_exchange(
        &self,
        _: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoExchangeStream>, Status> {
        only_actions()
    }

    async fn do_action(
        &self,
        request: Request<Action>,
    ) -> Result<Response<Self::DoActionStream>, Status> {
        let action = request.into_inner();
        let bad = |e: prost::DecodeError| {
            Status::invalid_argument(format!(
                "{} body is not a valid message: {e}",
                action.r#type
            ))
        };
        let body = match action.r#type.as_str() {
            PUBLISH => {
                // Merging a task's hashes (and building the filter once the set is
                // complete) is CPU work: off the RPC threads.
                let m = PublishMsg::decode(action.body.as_ref()).map_err(bad)?;
                let board = self.0.clone();
                tokio::task::spawn_blocking(move || board.publish(m))
                    .await
                    .map_err(|e| Status::internal(format!("publishing join keys: {e}")))??;
                Vec::new()
            }
            FETCH => {
                let m = FetchMsg::decode(action.body.as_ref()).map_err(bad)?;
                self.0
                    .fetch(&m.key, Duration::from_millis(m.wait_ms))
                    .await?
                    .encode_to_vec()
            }
            PUT_MODULE => {
                let sandbox = local_sandbox().map_err(|e| Status::internal(e.to_string()))?;
                let m = sandbox.compile(&action.body).await.map_err(|e| {
                    let s = e.to_status();
                    Status::new(
                        s.code(),
                        format!("the worker cannot load the module: {}", s.message()),
                    )
                })?;
                m.digest.hex().into_bytes()
            }
            other => {
                return Err(Status::invalid_argument(format!(
                    "unknown action {other:?}: a csd worker's own service serves {PUBLISH}, {FETCH} and {PUT_MODULE}"
                )));
            }
        };
        let one =
            futures::stream::once(async move { Ok(arrow_flight::Result { body: body.into() }) });
        Ok(Response::new(one.boxed()))
    }

    async fn list_actions(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListActionsStream>, Status> {
        let actions = [
            (PUBLISH, "a build task's join keys (csd's PublishMsg)"),
            (
                FETCH,
                "the bloom filter of a complete key set (csd's FetchMsg)",
            ),
        ]
        .map(|(t, d)| {
            Ok(ActionType {
                r#type: t.into(),
                description: d.into(),
            })
        });
        Ok(Response::new(futures::stream::iter(actions).boxed()))
    }
}

/// A client of the worker at `home` (one channel per worker, made lazily, shared).
pub(crate) fn client(home: &str) -> Result<FlightServiceClient<Channel>, String> {
    static CHANNELS: OnceLock<Mutex<HashMap<String, Channel>>> = OnceLock::new();
    let mut channels = CHANNELS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let channel = match channels.get(home) {
        Some(c) => c.clone(),
        None => {
            let c = Endpoint::from_shared(home.to_string())
                .map_err(|e| format!("worker address {home}: {e}"))?
                .tcp_nodelay(true)
                .connect_timeout(Duration::from_secs(5))
                .connect_lazy();
            channels.insert(home.to_string(), c.clone());
            c
        }
    };
    Ok(FlightServiceClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE))
}

/// Action `kind` at the worker `home`, expected to take up to `wait`: its answer.
pub(crate) async fn call(
    home: &str,
    kind: &str,
    body: Vec<u8>,
    wait: Duration,
) -> Result<Vec<u8>, String> {
    let mut c = client(home)?;
    let mut request = Request::new(Action {
        r#type: kind.into(),
        body: body.into(),
    });
    request.set_timeout(wait + CALL_SLACK);
    let mut answer = c
        .do_action(request)
        .await
        .map_err(|s| format!("worker {home}: {}", s.message()))?
        .into_inner();
    match answer.next().await {
        Some(Ok(r)) => Ok(r.body.to_vec()),
        Some(Err(s)) => Err(format!("worker {home}: {}", s.message())),
        None => Err(format!("worker {home}: no answer")),
    }
}

/// Sends `module` to the worker `home` (compiled there once); its digest as the
/// worker computed it.
pub(crate) async fn put_module(home: &str, module: &[u8]) -> Result<String, String> {
    let answer = call(home, PUT_MODULE, module.to_vec(), Duration::from_secs(60)).await?;
    String::from_utf8(answer).map_err(|_| format!("worker {home}: a bad answer to {PUT_MODULE}"))
}
