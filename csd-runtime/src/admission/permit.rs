//! What a request holds while it waits or runs: a queue place (given up if its
//! asker goes away), a slot ([`Permit`]: released, and its time learned, when
//! dropped), or a raw read's slot ([`ReadPermit`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Admission;
use super::ask::Kept;

/// Removes a queued request whose future was dropped (client gone).
pub(super) struct QueueGuard {
    pub(super) adm: Arc<Admission>,
    pub(super) id: u64,
    pub(super) armed: bool,
}

impl Drop for QueueGuard {
    fn drop(&mut self) {
        if self.armed {
            self.adm
                .waiters
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&self.id);
            let now = self.adm.now();
            let started = self.adm.ctl().abandon(self.id, now);
            self.adm.wake(started);
        }
    }
}

/// A running request's slot; released (and its time learned) when dropped.
#[derive(Debug)]
pub struct Permit {
    pub(super) adm: Arc<Admission>,
    pub(super) id: u64,
    pub(super) started: Instant,
    /// The estimated run time.
    pub estimate: Duration,
    /// The queueing predicted when it was queued (scaled; zero if it ran at once).
    pub predicted: Duration,
    /// How long it waited in the queue.
    pub waited: Duration,
    /// Why it queued past the delay bound, if it did (see "Pricing the link").
    pub kept: Option<Kept>,
    pub(super) completed: bool,
}

impl Permit {
    /// Marks the request as run to completion, so its time teaches the cost model.
    pub fn complete(&mut self) {
        self.completed = true;
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let busy = self.started.elapsed();
        let now = self.adm.now();
        let started = self.adm.ctl().finish(self.id, now, busy, self.completed);
        self.adm.wake(started);
    }
}

/// A raw read's slot.
#[derive(Debug)]
pub struct ReadPermit {
    pub(super) adm: Arc<Admission>,
    pub(super) started: Instant,
}

impl Drop for ReadPermit {
    fn drop(&mut self) {
        self.adm.io_release(self.started.elapsed());
    }
}
