//! `LocalGate`: how many pushed-back fragments the compute tier evaluates at once,
//! and in which order.
//!
//! A node that is short of CPU hands fragments back. Left alone, every one of them
//! would run at once on the compute tier, each getting a sliver of its cores, so that
//! under overload none finishes in good time (processor sharing). The gate gives its
//! slots (one per compute core) to the oldest handed-back fragment first: a fragment
//! holds a slot while it produces a batch, including the range reads that batch needs,
//! and gives it up between batches, so a consumer that stops polling never holds a
//! slot another stream waits for.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use datafusion::common::Result;
use datafusion::physical_plan::SendableRecordBatchStream;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::Stream;

/// Slots for local evaluation, given oldest first.
#[derive(Debug)]
pub struct LocalGate {
    slots: usize,
    seq: AtomicU64,
    epoch: Instant,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    busy: usize,
    /// Waiters by (arrival, sequence): the first is served first.
    waiting: BTreeMap<(u64, u64), Waker>,
}

impl LocalGate {
    /// A gate of `slots` slots (at least one).
    pub fn new(slots: usize) -> Arc<Self> {
        Arc::new(LocalGate {
            slots: slots.max(1),
            seq: AtomicU64::new(0),
            epoch: Instant::now(),
            state: Mutex::new(State::default()),
        })
    }

    /// One slot per core of this process.
    pub(crate) fn per_core() -> Arc<Self> {
        Self::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }

    /// Whether a fragment handed back now would wait a whole round: every slot is
    /// busy and as many fragments wait already.
    pub fn saturated(&self) -> bool {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.busy >= self.slots && s.waiting.len() >= self.slots
    }

    /// Fraction of the gate's slots busy, with waiters counted (at most 1): sent to the
    /// nodes, which price handing work back to a busy tier higher.
    pub fn load(&self) -> f64 {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        ((s.busy + s.waiting.len()) as f64 / self.slots as f64).min(1.0)
    }

    /// Streams a fragment about to run under the gate may use (at most `most`): as
    /// many as the gate has slots while none is busy and nobody waits, else one.
    /// A fragment's parallel streams run as tasks of their own from the moment it
    /// starts, which the gate cannot hold back between batches; under load each
    /// fragment runs in the one stream the gate orders.
    pub(crate) fn streams(&self, most: usize) -> usize {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match s.busy == 0 && s.waiting.is_empty() {
            true => self.slots.min(most).max(1),
            false => 1,
        }
    }

    /// `stream`, run under the gate, ranked by now (its arrival).
    pub fn run(self: &Arc<Self>, stream: SendableRecordBatchStream) -> SendableRecordBatchStream {
        let key = (
            self.epoch.elapsed().as_nanos() as u64,
            self.seq.fetch_add(1, Ordering::Relaxed),
        );
        let schema = stream.schema();
        Box::pin(RecordBatchStreamAdapter::new(
            schema,
            Gated {
                gate: self.clone(),
                key,
                held: false,
                inner: stream,
            },
        ))
    }

    /// Takes a slot for `key` if one is free and nobody older waits; otherwise
    /// (re)registers `waker`.
    fn try_take(&self, key: (u64, u64), waker: &Waker) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let first = s.waiting.keys().next().is_none_or(|k| *k >= key);
        if s.busy < self.slots && first {
            s.waiting.remove(&key);
            s.busy += 1;
            // Another slot may be free for the next waiter too.
            if s.busy < self.slots
                && let Some(w) = s.waiting.values().next()
            {
                w.wake_by_ref();
            }
            return true;
        }
        s.waiting.insert(key, waker.clone());
        false
    }

    fn give_back(&self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.busy = s.busy.saturating_sub(1);
        if let Some(w) = s.waiting.values().next() {
            w.wake_by_ref();
        }
    }

    fn forget(&self, key: (u64, u64)) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.waiting.remove(&key).is_some()
            && s.busy < self.slots
            && let Some(w) = s.waiting.values().next()
        {
            w.wake_by_ref();
        }
    }

    #[cfg(test)]
    fn busy(&self) -> usize {
        self.state.lock().map(|s| s.busy).unwrap_or(0)
    }
}

struct Gated {
    gate: Arc<LocalGate>,
    key: (u64, u64),
    held: bool,
    inner: SendableRecordBatchStream,
}

impl Stream for Gated {
    type Item = Result<arrow::record_batch::RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if !this.held {
            if !this.gate.try_take(this.key, cx.waker()) {
                return Poll::Pending;
            }
            this.held = true;
        }
        let next = this.inner.as_mut().poll_next(cx);
        if next.is_ready() {
            this.held = false;
            this.gate.give_back();
        }
        next
    }
}

impl Drop for Gated {
    fn drop(&mut self) {
        if self.held {
            self.gate.give_back();
        } else {
            self.gate.forget(self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int32Array;
    use arrow::datatypes::{DataType, Field, Schema};
    use arrow::record_batch::RecordBatch;
    use futures::StreamExt;

    fn stream(tag: i32, batches: usize) -> SendableRecordBatchStream {
        let schema = Arc::new(Schema::new(vec![Field::new("t", DataType::Int32, false)]));
        let b = RecordBatch::try_new(schema.clone(), vec![Arc::new(Int32Array::from(vec![tag]))])
            .unwrap();
        let s = futures::stream::iter((0..batches).map(move |_| Ok(b.clone())));
        Box::pin(RecordBatchStreamAdapter::new(schema, s))
    }

    #[test]
    fn parallel_streams_only_while_the_gate_is_idle() {
        let gate = LocalGate::new(2);
        assert_eq!(gate.streams(4), 2, "idle: one stream per slot");
        assert_eq!(gate.streams(1), 1);
        assert_eq!(LocalGate::new(8).streams(4), 4, "at most what was asked");
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let mut a = gate.run(stream(1, 2));
        assert!(matches!(
            a.poll_next_unpin(&mut cx),
            Poll::Ready(Some(Ok(_)))
        ));
        assert_eq!(
            gate.streams(4),
            2,
            "a slot is busy only while a batch is made"
        );
        assert!(gate.try_take((0, 0), &waker) && gate.try_take((0, 1), &waker));
        assert_eq!(gate.streams(4), 1, "slots busy: one stream");
        let mut b = gate.run(stream(2, 1));
        assert!(b.poll_next_unpin(&mut cx).is_pending());
        gate.give_back();
        gate.give_back();
        assert_eq!(gate.busy(), 0);
        assert_eq!(gate.streams(4), 1, "a fragment waiting: one stream");
        assert!(matches!(
            b.poll_next_unpin(&mut cx),
            Poll::Ready(Some(Ok(_)))
        ));
        drop((a, b));
        assert_eq!(gate.streams(4), 2, "idle again");
    }

    #[tokio::test]
    async fn oldest_first_one_batch_at_a_time_and_nothing_leaks() {
        let gate = LocalGate::new(1);
        let mut a = gate.run(stream(1, 2));
        let mut b = gate.run(stream(2, 1));
        let mut c = gate.run(stream(3, 1));
        // c asks first but b is older and waiting: b goes before c once a is done
        // with its batch.
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(matches!(
            a.poll_next_unpin(&mut cx),
            Poll::Ready(Some(Ok(_)))
        ));
        assert_eq!(gate.busy(), 0, "a slot is held only while a batch is made");
        // b registers as a waiter behind nobody and takes the slot at once.
        assert!(matches!(
            b.poll_next_unpin(&mut cx),
            Poll::Ready(Some(Ok(_)))
        ));
        // Register c, then a (older) while the slot is free: a must win over c.
        {
            let mut s = gate.state.lock().unwrap();
            s.busy = 1; // as if someone else held it
        }
        assert!(c.poll_next_unpin(&mut cx).is_pending());
        assert!(a.poll_next_unpin(&mut cx).is_pending());
        gate.give_back();
        assert!(
            c.poll_next_unpin(&mut cx).is_pending(),
            "older a goes first"
        );
        assert!(matches!(
            a.poll_next_unpin(&mut cx),
            Poll::Ready(Some(Ok(_)))
        ));
        assert!(matches!(
            c.poll_next_unpin(&mut cx),
            Poll::Ready(Some(Ok(_)))
        ));
        // Dropping a waiter forgets it; dropping finished streams frees everything.
        {
            let mut s = gate.state.lock().unwrap();
            s.busy = 1;
        }
        let mut d = gate.run(stream(4, 1));
        assert!(d.poll_next_unpin(&mut cx).is_pending());
        drop(d);
        gate.give_back();
        assert!(gate.state.lock().unwrap().waiting.is_empty());
        drop((a, b, c));
        assert_eq!(gate.busy(), 0);
        assert!(!gate.saturated());
    }

    #[tokio::test]
    async fn never_more_than_its_slots() {
        let gate = LocalGate::new(2);
        let running = Arc::new(AtomicU64::new(0));
        let peak = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for i in 0..8 {
            let (running, peak) = (running.clone(), peak.clone());
            let schema = Arc::new(Schema::new(vec![Field::new("t", DataType::Int32, false)]));
            let s2 = schema.clone();
            let slow = futures::stream::iter(0..3).then(move |_| {
                let (running, peak, schema) = (running.clone(), peak.clone(), s2.clone());
                async move {
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    peak.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(std::time::Duration::from_millis(2)).await;
                    running.fetch_sub(1, Ordering::SeqCst);
                    Ok(RecordBatch::try_new(
                        schema,
                        vec![Arc::new(Int32Array::from(vec![i]))],
                    )?)
                }
            });
            let s = gate.run(Box::pin(RecordBatchStreamAdapter::new(schema, slow)));
            tasks.push(tokio::spawn(async move { s.count().await }));
        }
        for t in tasks {
            assert_eq!(t.await.unwrap(), 3);
        }
        assert_eq!(peak.load(Ordering::SeqCst), 2);
        assert_eq!(gate.busy(), 0);
    }
}
