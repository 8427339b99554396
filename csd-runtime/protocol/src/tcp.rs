//! Connections a gRPC server accepts, with `TCP_NODELAY` set: without it a small
//! write after a large one (an answer's trailers, a short range) waits for the
//! peer's delayed ACK, up to 40 ms per request on a quiet connection, and tonic's
//! `serve_with_incoming` does not set it. The node, the gateway and the workers
//! serve through it.

use futures::Stream;
use tokio::net::{TcpListener, TcpStream};

/// `listener`'s connections, each with `TCP_NODELAY`.
pub fn incoming(listener: TcpListener) -> impl Stream<Item = std::io::Result<TcpStream>> {
    futures::stream::unfold(listener, |listener| async move {
        let conn = listener.accept().await.map(|(c, _)| c);
        if let Ok(c) = &conn
            && let Err(e) = c.set_nodelay(true)
        {
            tracing::warn!("TCP_NODELAY on an accepted connection: {e}");
        }
        Some((conn, listener))
    })
}
