//! The worker's own actions as a client calls them (the server is `service.rs`):
//! their names, their message size, and one call to a worker.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use arrow_flight::Action;
use arrow_flight::flight_service_client::FlightServiceClient;
use csd_protocol::{Error, StatusCode};
use futures::StreamExt;
use tonic::Request;
use tonic::transport::{Channel, Endpoint};

use crate::wire::keyfilter::MAX_FILTER_BYTES;

/// The action a build task publishes its keys with.
pub(crate) const PUBLISH: &str = "csd.keys.publish";
/// The action a scan task fetches the filter with.
pub(crate) const FETCH: &str = "csd.keys.fetch";

/// The action a coordinator sends a session's Wasm module with.
pub(crate) const PUT_MODULE: &str = "csd.module.put";

/// Largest message the board and its clients exchange: a task's distinct keys at the
/// fewest bits per key a filter allows, with room for the envelope.
pub(crate) const MAX_MESSAGE: usize = MAX_FILTER_BYTES * 8 * 8 + (1 << 20);

/// A client's allowance beyond the time it expects the worker to take.
const CALL_SLACK: Duration = Duration::from_secs(10);

/// A client of the worker at `home` (one channel per worker, made lazily, shared).
pub(crate) fn client(home: &str) -> Result<FlightServiceClient<Channel>, Error> {
    static CHANNELS: OnceLock<Mutex<HashMap<String, Channel>>> = OnceLock::new();
    let mut channels = CHANNELS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let channel = match channels.get(home) {
        Some(c) => c.clone(),
        None => {
            let c = Endpoint::from_shared(home.to_string())
                .map_err(|e| {
                    Error::external(
                        StatusCode::InvalidArgument,
                        format!("worker address {home}"),
                        e,
                    )
                })?
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
) -> Result<Vec<u8>, Error> {
    let mut c = client(home)?;
    let mut request = Request::new(Action {
        r#type: kind.into(),
        body: body.into(),
    });
    request.set_timeout(wait + CALL_SLACK);
    let from = |s| Error::from_status(format!("worker {home}"), s);
    let mut answer = c.do_action(request).await.map_err(from)?.into_inner();
    match answer.next().await {
        Some(Ok(r)) => Ok(r.body.to_vec()),
        Some(Err(s)) => Err(from(s)),
        None => Err(Error::Unavailable(format!(
            "worker {home}: no answer to {kind}"
        ))),
    }
}

/// Sends `module` to the worker `home` (compiled there once); its digest as the
/// worker computed it.
#[cfg(feature = "wasm")]
pub(crate) async fn put_module(home: &str, module: &[u8]) -> Result<String, Error> {
    let answer = call(home, PUT_MODULE, module.to_vec(), Duration::from_secs(60)).await?;
    String::from_utf8(answer).map_err(|e| {
        Error::external(
            StatusCode::Internal,
            format!("worker {home}: the answer to {PUT_MODULE}"),
            e,
        )
    })
}
