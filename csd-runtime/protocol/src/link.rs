//! What a link carries, learned from the transfers that cross it.
//!
//! A [`LinkMeter`] watches the raw transfers to (or from) one peer. Transfers that
//! overlap form one busy period; when a busy period ends having moved at least
//! [`MIN_SAMPLE_BYTES`], its bytes over its duration are one sample of the link's
//! throughput, folded into an exponentially weighted mean. Parallel reads therefore
//! measure the link, not one stream's share of it. A sample also includes whatever
//! slowed the sender (device reads, encoding), so it never overstates the link.
//!
//! The node keeps one meter per peer address (its raw `Range` answers) and prices
//! handing work back with it (`csd_runtime::admission` at the node); the compute tier keeps one
//! per node (its byte-range reads) and sends its figure with each operator request.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// A busy period must move this much to count (smaller ones measure latency).
pub const MIN_SAMPLE_BYTES: u64 = 1 << 20;
/// Weight of a new sample.
const LEARNING_RATE: f64 = 0.3;
/// Peers remembered by a [`LinkMeters`] at most.
const MAX_PEERS: usize = 1024;

#[derive(Debug, Default)]
struct State {
    active: usize,
    started: Option<Instant>,
    bytes: u64,
    estimate: Option<f64>,
    samples: u64,
    /// Bytes of work handed back to this peer that its link has not carried yet (as
    /// of `backlog_at`, draining at the link's throughput).
    backlog: f64,
    backlog_at: Option<Instant>,
}

impl State {
    fn drain(&mut self, link: f64) {
        let now = Instant::now();
        if let Some(at) = self.backlog_at {
            let carried = link * now.duration_since(at).as_secs_f64();
            self.backlog = (self.backlog - carried).max(0.0);
        }
        self.backlog_at = Some(now);
    }
}

/// Throughput of one link, learned from its busy periods.
#[derive(Debug, Default)]
pub struct LinkMeter {
    state: Mutex<State>,
}

impl LinkMeter {
    /// A meter that knows nothing yet.
    pub fn new() -> Arc<Self> {
        Arc::new(LinkMeter::default())
    }

    /// Starts a transfer; count its bytes on the guard, which ends it when dropped.
    pub fn transfer(self: &Arc<Self>) -> Transfer {
        if let Ok(mut s) = self.state.lock() {
            if s.active == 0 {
                s.started = Some(Instant::now());
                s.bytes = 0;
            }
            s.active += 1;
        }
        Transfer {
            meter: self.clone(),
        }
    }

    /// Learned bytes per second, once a busy period was large enough.
    pub fn bytes_per_sec(&self) -> Option<f64> {
        self.state.lock().ok().and_then(|s| s.estimate)
    }

    /// Bytes handed back to this peer that a link of `link` bytes/s has not carried
    /// yet: a fragment handed back now would queue behind them on the link.
    pub fn backlog(&self, link: f64) -> u64 {
        let Ok(mut s) = self.state.lock() else {
            return 0;
        };
        s.drain(link);
        s.backlog as u64
    }

    /// `bytes` of work were handed back to this peer, to cross a link of `link`
    /// bytes/s.
    pub fn handed_back(&self, bytes: u64, link: f64) {
        if let Ok(mut s) = self.state.lock() {
            s.drain(link);
            s.backlog += bytes as f64;
        }
    }

    /// Samples learned from.
    pub fn samples(&self) -> u64 {
        self.state.lock().map(|s| s.samples).unwrap_or(0)
    }

    fn end(&self) {
        let Ok(mut s) = self.state.lock() else {
            return;
        };
        s.active = s.active.saturating_sub(1);
        if s.active > 0 {
            return;
        }
        let Some(started) = s.started.take() else {
            return;
        };
        let secs = started.elapsed().as_secs_f64();
        if s.bytes < MIN_SAMPLE_BYTES || secs <= 0.0 {
            return;
        }
        let sample = s.bytes as f64 / secs;
        s.estimate = Some(match s.estimate {
            None => sample,
            Some(e) => e + LEARNING_RATE * (sample - e),
        });
        s.samples += 1;
    }
}

/// One transfer in progress on a [`LinkMeter`].
#[derive(Debug)]
pub struct Transfer {
    meter: Arc<LinkMeter>,
}

impl Transfer {
    /// Counts `n` bytes moved.
    pub fn add(&self, n: u64) {
        if let Ok(mut s) = self.meter.state.lock() {
            s.bytes += n;
        }
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        self.meter.end();
    }
}

/// One [`LinkMeter`] per peer address.
#[derive(Debug, Default)]
pub struct LinkMeters {
    peers: Mutex<HashMap<IpAddr, Arc<LinkMeter>>>,
}

impl LinkMeters {
    /// The meter of `peer` (a new one for a peer not seen before).
    pub fn of(&self, peer: IpAddr) -> Arc<LinkMeter> {
        let Ok(mut peers) = self.peers.lock() else {
            return LinkMeter::new();
        };
        if peers.len() >= MAX_PEERS && !peers.contains_key(&peer) {
            // Forget peers that taught nothing; else start over.
            peers.retain(|_, m| m.samples() > 0);
            if peers.len() >= MAX_PEERS {
                peers.clear();
            }
        }
        peers.entry(peer).or_default().clone()
    }

    /// What `peer`'s link carries, if learned.
    pub fn bytes_per_sec(&self, peer: IpAddr) -> Option<f64> {
        self.peers
            .lock()
            .ok()
            .and_then(|p| p.get(&peer).and_then(|m| m.bytes_per_sec()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn overlapping_transfers_measure_the_link_not_one_stream() {
        let m = LinkMeter::new();
        let a = m.transfer();
        let b = m.transfer();
        a.add(2 << 20);
        b.add(2 << 20);
        std::thread::sleep(Duration::from_millis(40));
        drop(a);
        assert_eq!(m.bytes_per_sec(), None, "still busy: no sample yet");
        drop(b);
        let bps = m.bytes_per_sec().expect("one busy period of 4 MiB");
        // 4 MiB in a little over 40 ms: at most 100 MiB/s, and not one stream's half.
        assert!(bps <= (4 << 20) as f64 / 0.040, "{bps}");
        assert!(bps > (4 << 20) as f64 / 0.5, "{bps}");
        assert_eq!(m.samples(), 1);
    }

    #[test]
    fn work_handed_back_drains_at_the_links_throughput() {
        let m = LinkMeter::new();
        assert_eq!(m.backlog(1e6), 0);
        m.handed_back(100_000, 1e6);
        m.handed_back(100_000, 1e6);
        let now = m.backlog(1e6);
        assert!(now > 150_000 && now <= 200_000, "{now}");
        // 1 MB/s carries 200 kB in 200 ms.
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(m.backlog(1e6), 0);
    }

    #[test]
    fn small_transfers_teach_nothing() {
        let m = LinkMeter::new();
        let t = m.transfer();
        t.add(1000);
        drop(t);
        assert_eq!(m.bytes_per_sec(), None);
        assert_eq!(m.samples(), 0);
    }

    #[test]
    fn meters_are_per_peer() {
        let meters = LinkMeters::default();
        let p: IpAddr = "10.0.0.1".parse().unwrap();
        let q: IpAddr = "10.0.0.2".parse().unwrap();
        let t = meters.of(p).transfer();
        t.add(MIN_SAMPLE_BYTES);
        std::thread::sleep(Duration::from_millis(2));
        drop(t);
        assert!(meters.bytes_per_sec(p).is_some());
        assert_eq!(meters.bytes_per_sec(q), None);
    }
}
