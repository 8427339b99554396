//! The node's background scrub (`--scrub-rate`): every object read back from the
//! device and checked against its checksums, pass after pass, at most `rate` bytes
//! a second, each piece read holding one of admission's raw-read slots like any
//! other read (so it waits its turn and never takes more than one slot).

use std::sync::Weak;
use std::time::{Duration, Instant};

use crate::admission::{Admission, ReadPermit};
use crate::state::NodeState;
use crate::store::{Pace, Turn};

/// Pause between the end of one pass and the start of the next.
const BETWEEN_PASSES: Duration = Duration::from_secs(60);

/// Scrubs `state`'s store at `rate` bytes a second until the node is gone.
pub(crate) async fn scrub_every(state: Weak<NodeState>, rate: u64) {
    loop {
        let (store, admission) = match state.upgrade() {
            Some(s) => (s.store().clone(), s.admission.clone()),
            None => return,
        };
        let mut pace = Rated {
            admission,
            node: state.clone(),
            rate: rate.max(1),
            started: Instant::now(),
            bytes: 0,
        };
        match store.scrub_paced("", &mut pace).await {
            Ok(r) if r.damaged_count == 0 => tracing::info!(
                objects = r.objects,
                bytes = r.bytes,
                seconds = r.seconds,
                "background scrub: a pass found no damage"
            ),
            Ok(r) => tracing::error!(
                objects = r.objects,
                damaged = r.damaged_count,
                first = r.damaged.first().map(String::as_str).unwrap_or(""),
                "background scrub: a pass found damaged ranges (`csd scrub` names them); \
                 put those partitions again, or let their reads go to another copy"
            ),
            Err(e) => tracing::error!("background scrub: a pass stopped: {e}"),
        }
        drop(store);
        tokio::time::sleep(BETWEEN_PASSES).await;
    }
}

/// At most `rate` bytes a second since `started`, each piece in a raw-read slot.
struct Rated {
    admission: std::sync::Arc<Admission>,
    node: Weak<NodeState>,
    rate: u64,
    started: Instant,
    bytes: u64,
}

/// When the piece after `bytes` read at `rate` bytes a second may start.
fn due(started: Instant, bytes: u64, rate: u64) -> Instant {
    started + Duration::from_secs_f64(bytes as f64 / rate as f64)
}

impl Pace for Rated {
    type Turn = ReadPermit;

    async fn turn(&mut self, bytes: u64) -> Turn<ReadPermit> {
        tokio::time::sleep_until(due(self.started, self.bytes, self.rate).into()).await;
        self.bytes += bytes;
        loop {
            if self.node.strong_count() == 0 {
                return Turn::Stop;
            }
            match self.admission.read().await {
                Ok(permit) => return Turn::Go(permit),
                // The read queue is full: the node's own reads go first.
                Err(busy) => tokio::time::sleep(busy.retry_after).await,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_are_spaced_by_the_rate() {
        let t = Instant::now();
        assert_eq!(due(t, 0, 1 << 20), t);
        assert_eq!(due(t, 1 << 20, 1 << 20), t + Duration::from_secs(1));
        assert_eq!(due(t, 5 << 20, 2 << 20), t + Duration::from_millis(2500));
    }
}
