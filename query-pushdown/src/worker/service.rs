//! A worker's own Flight service, beside datafusion-distributed's on the same port:
//! what csd's workers exchange besides plans and batches. Actions (protobuf bodies):
//!
//! - `csd.keys.publish`, `csd.keys.fetch`: join-key sets across stages (see
//!   `keys.rs`);
//! - `csd.module.put`: a session's Wasm module, before its queries call the module's
//!   SQL functions on this worker (the worker compiles it once into its sandbox; a
//!   task's session then registers the functions the coordinator names in
//!   `csd.wasm_functions`).
//!
//! Like the worker service itself it trusts whoever reaches the port. Errors are
//! [`csd_protocol::Error`]s, made statuses by its one mapping.

use std::sync::Arc;
use std::time::Duration;

use arrow_flight::flight_service_server::{FlightService, FlightServiceServer};
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaResult, Ticket,
};
use csd_protocol::{Error, StatusCode};
use futures::StreamExt;
use futures::stream::BoxStream;
use prost::Message;
use tonic::{Request, Response, Status, Streaming};

use crate::compute::distributed::actions::{FETCH, MAX_MESSAGE, PUBLISH, PUT_MODULE};
use crate::compute::distributed::keys::{FetchMsg, KeyBoard, PublishMsg};

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
    Err(Error::Unimplemented(format!(
        "this is a csd worker's own service: it serves the actions {PUBLISH}, {FETCH} and {PUT_MODULE} only"
    ))
    .into())
}

impl WorkerActions {
    /// The answer to `action`.
    async fn answer(&self, action: Action) -> Result<Vec<u8>, Error> {
        let bad = |e: prost::DecodeError| {
            Error::external(
                StatusCode::InvalidArgument,
                format!("the body of {}", action.r#type),
                e,
            )
        };
        match action.r#type.as_str() {
            PUBLISH => {
                // Merging a task's hashes (and building the filter once the set is
                // complete) is CPU work: off the RPC threads.
                let m = PublishMsg::decode(action.body.as_ref()).map_err(bad)?;
                let board = self.0.clone();
                tokio::task::spawn_blocking(move || board.publish(m))
                    .await
                    .map_err(|e| {
                        Error::external(StatusCode::Internal, "publishing join keys", e)
                    })??;
                Ok(Vec::new())
            }
            FETCH => {
                let m = FetchMsg::decode(action.body.as_ref()).map_err(bad)?;
                Ok(self
                    .0
                    .fetch(&m.key, Duration::from_millis(m.wait_ms))
                    .await?
                    .encode_to_vec())
            }
            PUT_MODULE => put_module(&action.body).await,
            other => Err(Error::InvalidArgument(format!(
                "unknown action {:?}: a csd worker's own service serves {PUBLISH}, {FETCH} and {PUT_MODULE}",
                csd_protocol::error::truncated(other)
            ))),
        }
    }
}

/// `csd.module.put`: the module compiled once into this worker's sandbox; answers
/// its digest.
#[cfg(feature = "wasm")]
async fn put_module(module: &[u8]) -> Result<Vec<u8>, Error> {
    let sandbox = crate::compute::sandbox::local_sandbox()
        .map_err(|e| Error::external(StatusCode::Internal, "the worker's sandbox", e))?;
    let m = sandbox
        .compile(module)
        .await
        .map_err(|e| Error::external(e.status_code(), "the worker cannot load the module", e))?;
    Ok(m.digest.hex().into_bytes())
}

/// Without shipped code a worker refuses modules.
#[cfg(not(feature = "wasm"))]
async fn put_module(_: &[u8]) -> Result<Vec<u8>, Error> {
    Err(Error::Unimplemented(
        "this worker was built without shipped code (the wasm feature)".into(),
    ))
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
        let body = self.answer(request.into_inner()).await?;
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::compute::distributed::keys::FlightKeyBoard;
    use crate::compute::distributed::keys::tests::hashes;
    use crate::compute::key_collector::{KeyMeeting, RemoteKeys};
    use crate::compute::no_filter::NoFilter;

    /// Over gRPC: a board served on a port, published to and fetched from by the
    /// clients the collectors use; other calls are refused with a reason.
    #[tokio::test]
    async fn publish_and_fetch_over_grpc() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let home = format!("http://{}", listener.local_addr().unwrap());
        let board = Arc::new(KeyBoard::default());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(WorkerActions(board).into_server())
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let remote = RemoteKeys {
            home: home.clone(),
            key: "q/7".into(),
            wait_ms: 5000,
        };
        let many = hashes(0..200_000);
        FlightKeyBoard
            .publish(&remote, (0, 2), 12, Ok(many.clone()))
            .await
            .unwrap();
        FlightKeyBoard
            .publish(&remote, (1, 2), 12, Ok(vec![7]))
            .await
            .unwrap();
        let (bloom, keys) = FlightKeyBoard
            .fetch(&remote, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(keys, 200_001);
        assert!(many.iter().all(|&h| bloom.contains(h)) && bloom.contains(7));

        let gone = RemoteKeys {
            key: "q/8".into(),
            ..remote.clone()
        };
        FlightKeyBoard
            .publish(&gone, (0, 1), 12, Err(NoFilter::BuildStopped))
            .await
            .unwrap();
        let e = FlightKeyBoard
            .fetch(&gone, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert_eq!(
            e,
            NoFilter::TaskGaveUp {
                task: 0,
                why: Box::new(NoFilter::BuildStopped)
            }
        );

        let mut c = crate::compute::distributed::actions::client(&home).unwrap();
        let e = c
            .do_get(arrow_flight::Ticket::new("x"))
            .await
            .map(|_| ())
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unimplemented);
        assert!(e.message().contains("worker's own service"), "{e}");
        let nowhere = RemoteKeys {
            home: "http://127.0.0.1:1".into(),
            ..remote
        };
        let e = FlightKeyBoard
            .fetch(&nowhere, Duration::from_millis(100))
            .await
            .unwrap_err();
        assert!(
            matches!(&e, NoFilter::Unreachable(at) if at.home == "http://127.0.0.1:1"),
            "{e}"
        );
    }
}
