//! Raw reads (the pushed-back fallback and the no-pushdown path): cheap in CPU but
//! still bounded, `io_in_flight` at once and `io_queue` waiting; beyond that a
//! rejection with a retry hint from the measured service time.

use std::time::Duration;

use super::ask::Reject;
use super::config::AdmissionConfig;

/// Raw reads in flight and waiting.
#[derive(Debug)]
pub(super) struct Reads {
    pub(super) in_flight: usize,
    pub(super) waiting: usize,
    /// A read's service time, smoothed.
    service: Duration,
}

impl Reads {
    /// None yet.
    pub(super) fn new() -> Self {
        Reads {
            in_flight: 0,
            waiting: 0,
            service: Duration::from_millis(2),
        }
    }

    /// The rejection a read (or an operator request that would be handed back)
    /// gets while the queue is full.
    pub(super) fn saturated(&self, cfg: &AdmissionConfig) -> Option<Reject> {
        (self.waiting >= cfg.io_queue).then(|| {
            let drain = self.service * (self.waiting as u32 / cfg.io_in_flight as u32 + 1);
            Reject {
                reason: format!(
                    "the node cannot serve more reads now ({} in flight, {} waiting)",
                    self.in_flight, self.waiting
                ),
                retry_after: drain.max(Duration::from_millis(10)),
            }
        })
    }

    /// A read arrives: `Ok(true)` go now, `Ok(false)` wait, or a rejection.
    pub(super) fn offer(&mut self, cfg: &AdmissionConfig) -> Result<bool, Reject> {
        if self.in_flight < cfg.io_in_flight && self.waiting == 0 {
            self.in_flight += 1;
            return Ok(true);
        }
        if let Some(r) = self.saturated(cfg) {
            return Err(r);
        }
        self.waiting += 1;
        Ok(false)
    }

    /// A waiting read may start if a read slot is free.
    pub(super) fn dispatch(&mut self, cfg: &AdmissionConfig) -> bool {
        if self.in_flight < cfg.io_in_flight && self.waiting > 0 {
            self.waiting -= 1;
            self.in_flight += 1;
            return true;
        }
        false
    }

    /// A waiting read gave up.
    pub(super) fn abandon(&mut self) {
        self.waiting = self.waiting.saturating_sub(1);
    }

    /// A read that took `took` ended.
    pub(super) fn finish(&mut self, took: Duration) {
        self.in_flight = self.in_flight.saturating_sub(1);
        self.service = (self.service * 4 + took) / 5;
    }
}
