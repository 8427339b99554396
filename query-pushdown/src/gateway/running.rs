//! Answers being streamed, so that `CancelFlightInfo` (or the older `CancelQuery`)
//! can stop them: a cancelled answer ends with `CANCELLED` — never as if it were
//! complete — and dropping it stops the nodes' work, as a client that goes away
//! does.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arrow::record_batch::RecordBatch;
use arrow_flight::error::FlightError;
use bytes::Bytes;
use futures::{Stream, StreamExt};
use tokio::sync::watch;

use super::stats::{Counters, bump};

/// The answers streaming now, by ticket.
#[derive(Debug, Default)]
pub(crate) struct Running {
    next: AtomicU64,
    answers: Mutex<HashMap<u64, (Bytes, watch::Sender<bool>)>>,
}

impl Running {
    /// Cancels every answer of `ticket`; how many there were.
    pub(crate) fn cancel(&self, ticket: &[u8]) -> usize {
        let answers = self.answers.lock().unwrap_or_else(|p| p.into_inner());
        let mut n = 0;
        for (t, tx) in answers.values() {
            if t.as_ref() == ticket {
                let _ = tx.send(true);
                n += 1;
            }
        }
        n
    }

    /// `batches` as the answer to `ticket`: counted, and stopped with `CANCELLED`
    /// when cancelled.
    pub(crate) fn watch(
        self: &Arc<Self>,
        ticket: Bytes,
        batches: impl Stream<Item = Result<RecordBatch, FlightError>> + Send + 'static,
        counters: Arc<Counters>,
    ) -> impl Stream<Item = Result<RecordBatch, FlightError>> + Send + 'static {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = watch::channel(false);
        self.answers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, (ticket, tx));
        bump(&counters.queries);
        counters.running.fetch_add(1, Ordering::Relaxed);
        let guard = Guard {
            running: self.clone(),
            id,
            counters,
            ended: false,
        };
        futures::stream::unfold(
            (batches.boxed(), rx, guard),
            |(mut batches, mut rx, mut guard)| async move {
                if guard.ended {
                    return None;
                }
                let next = tokio::select! {
                    biased;
                    _ = rx.wait_for(|c| *c) => Some(Err(FlightError::Tonic(Box::new(
                        tonic::Status::cancelled("the query was cancelled (CancelFlightInfo)"),
                    )))),
                    b = batches.next() => b,
                };
                match &next {
                    Some(Ok(b)) => {
                        guard
                            .counters
                            .rows_sent
                            .fetch_add(b.num_rows() as u64, Ordering::Relaxed);
                    }
                    Some(Err(e)) => {
                        guard.ended = true;
                        let cancelled = matches!(e, FlightError::Tonic(s) if s.code() == tonic::Code::Cancelled);
                        bump(if cancelled {
                            &guard.counters.queries_cancelled
                        } else {
                            &guard.counters.queries_failed
                        });
                        guard.unregister();
                    }
                    None => {
                        guard.ended = true;
                        guard.unregister();
                    }
                }
                next.map(|n| (n, (batches, rx, guard)))
            },
        )
    }
}

/// Unregisters an answer; one dropped before its end was cancelled by its client.
struct Guard {
    running: Arc<Running>,
    id: u64,
    counters: Arc<Counters>,
    /// Its end or error was sent (and counted).
    ended: bool,
}

impl Guard {
    /// No longer running (once its end or error is sent: a cancel after that finds
    /// nothing to stop). Called once: at its end, or when dropped before it.
    fn unregister(&mut self) {
        self.running
            .answers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
        self.counters.running.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        // Dropped before its end: its client went away.
        if !self.ended {
            self.unregister();
            bump(&self.counters.queries_cancelled);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch() -> RecordBatch {
        RecordBatch::try_from_iter([(
            "a",
            Arc::new(arrow::array::Int32Array::from(vec![1, 2])) as _,
        )])
        .unwrap()
    }

    #[tokio::test]
    async fn cancel_ends_with_an_error_and_counts() {
        let running = Arc::new(Running::default());
        let counters = Arc::new(Counters::default());
        // An answer that never ends by itself.
        let endless =
            futures::stream::iter(std::iter::repeat_with(|| Ok(batch()))).then(|b| async move {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                b
            });
        let mut s = Box::pin(running.watch(Bytes::from_static(b"t1"), endless, counters.clone()));
        assert!(s.next().await.unwrap().is_ok());
        assert_eq!(running.cancel(b"other"), 0);
        assert_eq!(running.cancel(b"t1"), 1);
        let e = s.next().await.unwrap().unwrap_err();
        assert!(e.to_string().contains("cancelled"), "{e}");
        assert!(s.next().await.is_none());
        drop(s);
        let st = counters.snapshot();
        assert_eq!(
            (st.queries, st.queries_cancelled, st.running, st.rows_sent),
            (1, 1, 0, 2)
        );
        // A complete answer is not cancelled; one dropped early is.
        let s = running.watch(
            Bytes::from_static(b"t2"),
            futures::stream::iter([Ok(batch())]),
            counters.clone(),
        );
        assert_eq!(s.collect::<Vec<_>>().await.len(), 1);
        let mut s = Box::pin(running.watch(
            Bytes::from_static(b"t3"),
            futures::stream::iter([Ok(batch()), Ok(batch())]),
            counters.clone(),
        ));
        assert!(s.next().await.is_some());
        drop(s);
        let st = counters.snapshot();
        assert_eq!((st.queries, st.queries_cancelled, st.running), (3, 2, 0));
        assert_eq!(running.cancel(b"t1"), 0);
    }
}
