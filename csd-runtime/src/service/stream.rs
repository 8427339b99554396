//! How an answer leaves the node: a stream driven on the CPU pool and forwarded
//! through a small channel ([`TaskStream`]), holding what it runs under (a permit,
//! a request slot) until it ends or the asker goes away.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use arrow_flight::FlightData;
use arrow_flight::error::FlightError;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tonic::Status;

use super::FlightNode;
use crate::error::{Error, Result};
use crate::pool::AbortOnDrop;

/// The Flight encoder's own split limit, well above the node's `--wire-piece`:
/// batches arrive already cut by [`crate::operator::wire_pieces`], and the encoder,
/// which measures buffer capacity, would otherwise cut slices again.
pub(super) const ENCODER_LIMIT: usize = crate::protocol::MAX_MESSAGE_BYTES / 4;

/// `stream`, holding `permit` until it ends or is dropped.
pub(super) fn holding<S, T, G>(stream: S, permit: G) -> BoxStream<'static, T>
where
    S: Stream<Item = T> + Send + 'static,
    G: Send + 'static,
{
    stream
        .map(move |item| {
            let _held = &permit;
            item
        })
        .boxed()
}

/// `stream`'s bodies counted as one transfer on `link` (ended when it is dropped).
pub(super) fn metered(
    stream: BoxStream<'static, Result<FlightData, Status>>,
    link: Arc<crate::link::LinkMeter>,
) -> BoxStream<'static, Result<FlightData, Status>> {
    let transfer = link.transfer();
    stream
        .inspect(move |d| {
            if let Ok(d) = d {
                transfer.add(d.data_body.len() as u64);
            }
        })
        .boxed()
}

impl FlightNode {
    /// Drives `stream` on the CPU pool, forwarding items through a small channel.
    pub(super) fn run_stream<S>(&self, stream: S) -> TaskStream
    where
        S: Stream<Item = Result<FlightData, FlightError>> + Send + 'static,
        S: Unpin,
    {
        self.run_stream_then(stream, |_| None)
    }

    /// Like [`run_stream`](Self::run_stream); after the last item (if all went well)
    /// sends `trailer(bytes sent)` when that gives a message.
    pub(super) fn run_stream_then<S, T>(&self, stream: S, trailer: T) -> TaskStream
    where
        S: Stream<Item = Result<FlightData, FlightError>> + Send + 'static,
        S: Unpin,
        T: FnOnce(u64) -> Option<FlightData> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel(4);
        let task = self.state.node.pool.spawn(async move {
            forward(stream, &tx, trailer).await;
            Ok(())
        });
        TaskStream {
            rx,
            _task: task,
            sent: self.state.counters.bytes_sent.clone(),
            _waiting: None,
        }
    }
}

/// A response stream fed by a CPU-pool task, which is cancelled when the stream drops.
pub(super) struct TaskStream {
    pub(super) rx: mpsc::Receiver<Result<FlightData, Status>>,
    pub(super) _task: AbortOnDrop<Result<()>>,
    pub(super) sent: Arc<AtomicU64>,
    /// Tells the operator when the answer is no longer wanted.
    pub(super) _waiting: Option<crate::operator::CancelOnDrop>,
}

impl Stream for TaskStream {
    type Item = Result<FlightData, Status>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let p = self.rx.poll_recv(cx);
        if let Poll::Ready(Some(Ok(d))) = &p {
            self.sent.fetch_add(
                (d.data_body.len() + d.data_header.len()) as u64,
                Ordering::Relaxed,
            );
        }
        p
    }
}

/// Sends `stream`'s items to `tx` until the receiver goes or an item fails; after
/// the last item (if all went well) sends `trailer(bytes sent)` when that gives a
/// message.
pub(super) async fn forward<S, T>(
    mut stream: S,
    tx: &mpsc::Sender<Result<FlightData, Status>>,
    trailer: T,
) where
    S: Stream<Item = Result<FlightData, FlightError>> + Unpin,
    T: FnOnce(u64) -> Option<FlightData>,
{
    let mut sent = 0u64;
    while let Some(item) = stream.next().await {
        let item = item.map_err(|e| Error::from(e).to_status());
        let stop = item.is_err();
        if let Ok(d) = &item {
            sent += (d.data_body.len() + d.data_header.len()) as u64;
        }
        if tx.send(item).await.is_err() || stop {
            return;
        }
    }
    if let Some(last) = trailer(sent) {
        let _ = tx.send(Ok(last)).await;
    }
}
