//! A process-wide timer with microsecond precision, for emulation (device timing
//! models, link latency and pacing). tokio's timer wheel ticks in milliseconds, which
//! would turn an 80 µs NVMe read or a 100 µs link into a millisecond.
//!
//! One thread keeps a heap of deadlines and sleeps on a condition variable with its
//! timer slack set to 1 ns; waiters are tokio oneshots. It measures how late its own
//! timed waits wake (on a VM that grows with idle time, e.g. 9 µs after 100 µs and
//! 33 µs after 2 ms here), aims that much early and spins the rest: never early.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

/// Releases waiters at precise instants from a dedicated thread.
struct Timer {
    state: Mutex<TimerState>,
    cv: Condvar,
}

struct TimerState {
    heap: BinaryHeap<Reverse<Entry>>,
    seq: u64,
    stop: bool,
    /// How late a timed wait of this thread wakes, on average (EWMA, nanoseconds).
    /// Waits aim that much early, so releases land on time on any host.
    lateness_ns: f64,
}

/// Most the timer will aim early, whatever it measured.
const MAX_LEAD: Duration = Duration::from_micros(200);

struct Entry {
    at: Instant,
    seq: u64,
    tx: oneshot::Sender<()>,
}
impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Entry {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

/// Below this a wait is not worth a thread hand-off.
const TIMER_EPSILON: Duration = Duration::from_micros(5);

impl Timer {
    fn global() -> &'static Timer {
        static TIMER: OnceLock<&'static Timer> = OnceLock::new();
        TIMER.get_or_init(|| {
            let t: &'static Timer = Box::leak(Box::new(Timer {
                state: Mutex::new(TimerState {
                    heap: BinaryHeap::new(),
                    seq: 0,
                    stop: false,
                    lateness_ns: 0.0,
                }),
                cv: Condvar::new(),
            }));
            let spawned = std::thread::Builder::new()
                .name("csd-timer".into())
                .spawn(move || {
                    // SAFETY: prctl(PR_SET_TIMERSLACK) only changes this thread's timer slack.
                    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0) };
                    while t.tick() {}
                });
            if spawned.is_err() {
                // Without the thread nothing would fire: degrade to not waiting at all.
                t.state.lock().unwrap_or_else(|p| p.into_inner()).stop = true;
            }
            t
        })
    }

    /// Fires due entries, then waits until the next deadline (at most 100 ms): a
    /// timed wait aimed early by the measured lateness, then a spin for the rest, so
    /// that nothing is released before its instant (an early release would make a
    /// 100 µs link delay no delay at all once the lateness grows past it).
    fn tick(&self) -> bool {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let lead = Duration::from_nanos(st.lateness_ns as u64).min(MAX_LEAD);
        let now = Instant::now();
        while st
            .heap
            .peek()
            .is_some_and(|e| e.0.at <= now + TIMER_EPSILON)
        {
            if let Some(Reverse(e)) = st.heap.pop() {
                let _ = e.tx.send(());
            }
        }
        if let Some(next) = st.heap.peek().map(|e| e.0.at)
            && next <= now + lead
        {
            drop(st);
            while Instant::now() < next {
                std::hint::spin_loop();
            }
            return true;
        }
        let target = st
            .heap
            .peek()
            .map(|e| e.0.at.checked_sub(lead).unwrap_or(e.0.at));
        let wait = target
            .map(|t| t.saturating_duration_since(now))
            .unwrap_or(Duration::from_millis(100));
        let wait = wait.min(Duration::from_millis(100));
        let (mut st, res) = self
            .cv
            .wait_timeout(st, wait)
            .unwrap_or_else(|p| p.into_inner());
        if res.timed_out()
            && let Some(t) = target
            && wait < Duration::from_millis(100)
        {
            let late = Instant::now().saturating_duration_since(t).as_nanos() as f64;
            st.lateness_ns = 0.9 * st.lateness_ns + 0.1 * late;
        }
        true
    }

    async fn sleep_until(&self, at: Instant) {
        if at <= Instant::now() + TIMER_EPSILON {
            return;
        }
        if self.state.lock().unwrap_or_else(|p| p.into_inner()).stop {
            return;
        }
        let (tx, rx) = oneshot::channel();
        {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let seq = st.seq;
            st.seq += 1;
            let earliest = st.heap.peek().is_none_or(|e| at < e.0.at);
            st.heap.push(Reverse(Entry { at, seq, tx }));
            if earliest {
                self.cv.notify_one();
            }
        }
        let _ = rx.await;
    }
}

/// Completes at `at`, to within tens of microseconds.
pub async fn sleep_until(at: Instant) {
    Timer::global().sleep_until(at).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn sleeps_are_precise_and_ordered() {
        let t0 = Instant::now();
        let a = sleep_until(t0 + Duration::from_micros(300));
        let b = sleep_until(t0 + Duration::from_micros(100));
        let (ta, tb) = tokio::join!(
            async {
                a.await;
                t0.elapsed()
            },
            async {
                b.await;
                t0.elapsed()
            }
        );
        assert!(
            tb >= Duration::from_micros(80) && ta >= Duration::from_micros(280),
            "{tb:?} {ta:?}"
        );
        assert!(tb < ta);
    }
}
