//! What a query that failed on workers says: the workers it ran on, and which of
//! them stopped answering.
//!
//! A worker that reads from a lost worker reports that failure to the coordinator
//! as a DataFusion error sent over gRPC, and such an error arrives as text: its
//! causes' types stay on the worker that saw them. So besides the error's own
//! chain of causes (typed, for failures this process saw), the workers are asked
//! directly: each is dialled once, and those that do not take a connection are
//! named.

use std::time::Duration;

use datafusion::common::DataFusionError;
use futures::future::join_all;
use tonic::codegen::http::Uri;

/// How long a worker has to take a connection before it counts as stopped.
const DIAL_TIMEOUT: Duration = Duration::from_secs(1);

/// `e`, saying which of `workers` the query ran on (none: `e` as it is), and that
/// one of them stopped answering when that is what happened (naming it when it can
/// no longer be reached). `e` is kept whole as the cause.
pub(crate) async fn on_workers(workers: &[String], e: DataFusionError) -> DataFusionError {
    if workers.is_empty() {
        return e;
    }
    let down = unreachable(workers).await;
    let what = if !down.is_empty() {
        format!(
            "a worker stopped answering: {} (the query failed; run it again once it is up, \
             or without it)",
            down.join(", ")
        )
    } else if connection_broke(&e) {
        "a worker stopped answering (the query failed; run it again once the workers are up)"
            .to_string()
    } else {
        "the query failed on the workers".to_string()
    };
    DataFusionError::Context(
        format!("{what} [workers: {}]", workers.join(", ")),
        Box::new(e),
    )
}

/// The workers of `urls` that do not take a TCP connection within
/// [`DIAL_TIMEOUT`], dialled at once. A URL without a host or port is not judged.
async fn unreachable(urls: &[String]) -> Vec<String> {
    let dials = urls.iter().map(|url| async move {
        let uri: Uri = url.parse().ok()?;
        let (host, port) = (uri.host()?.trim_matches(['[', ']']), uri.port_u16()?);
        let dial = tokio::net::TcpStream::connect((host, port));
        match tokio::time::timeout(DIAL_TIMEOUT, dial).await {
            Ok(Ok(_)) => None,
            Ok(Err(_)) | Err(_) => Some(url.clone()),
        }
    });
    join_all(dials).await.into_iter().flatten().collect()
}

/// Whether `e` came from a connection that broke or could not be made: a status of
/// `Unavailable` (tonic's for a refused connection), a transport error, an HTTP/2
/// I/O failure or going away (a lost connection), or an I/O error of a
/// connection's kinds anywhere in its chain of causes.
fn connection_broke(e: &DataFusionError) -> bool {
    use std::io::ErrorKind;
    std::iter::successors(Some(e as &(dyn std::error::Error + 'static)), |c| {
        c.source()
    })
    .any(|c| {
        c.downcast_ref::<tonic::Status>()
            .is_some_and(|s| s.code() == tonic::Code::Unavailable)
            || c.downcast_ref::<tonic::transport::Error>().is_some()
            // HTTP/2 says the connection's I/O failed or the peer went away (its
            // errors name no source: the I/O error is inside).
            || c.downcast_ref::<h2::Error>()
                .is_some_and(|h| h.is_io() || h.is_go_away())
            || c.downcast_ref::<std::io::Error>().is_some_and(|io| {
                matches!(
                    io.kind(),
                    ErrorKind::BrokenPipe
                        | ErrorKind::ConnectionRefused
                        | ErrorKind::ConnectionReset
                        | ErrorKind::ConnectionAborted
                        | ErrorKind::NotConnected
                        | ErrorKind::UnexpectedEof
                )
            })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_worker_that_takes_no_connection_is_named() {
        let up = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let gone = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up_url = format!("grpc://{}", up.local_addr().unwrap());
        let gone_url = format!("grpc://{}", gone.local_addr().unwrap());
        drop(gone);
        let workers = [up_url.clone(), gone_url.clone()];
        let e = on_workers(&workers, DataFusionError::Execution("boom".into()))
            .await
            .to_string();
        assert!(
            e.starts_with(&format!("a worker stopped answering: {gone_url} ")),
            "{e}"
        );
        assert!(
            e.contains(&format!("[workers: {up_url}, {gone_url}]")),
            "{e}"
        );
        assert!(e.contains("boom"), "the cause is kept: {e}");
    }

    #[tokio::test]
    async fn a_failure_with_every_worker_up_is_not_called_a_lost_worker() {
        let up = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let workers = [format!("grpc://{}", up.local_addr().unwrap())];
        let e = on_workers(&workers, DataFusionError::Execution("1/0".into()))
            .await
            .to_string();
        assert!(
            e.starts_with("the query failed on the workers [workers: "),
            "{e}"
        );
        // A refused connection this process saw itself is a lost worker.
        let refused = DataFusionError::External(Box::new(tonic::Status::unavailable("gone")));
        let e = on_workers(&workers, refused).await.to_string();
        assert!(
            e.starts_with("a worker stopped answering (the query"),
            "{e}"
        );
    }

    #[tokio::test]
    async fn no_workers_leave_the_error_as_it_is() {
        let e = on_workers(&[], DataFusionError::Execution("x".into())).await;
        assert_eq!(e.to_string(), "Execution error: x");
    }
}
