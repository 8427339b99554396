//! What a request holds while it waits or runs: a queue place (given up if its
//! asker goes away), a slot ([`Permit`]: released, and its time learned, when
//! dropped), or a raw read's slot ([`ReadPermit`]).
//!
//! Each gives back to the admission that handed it out through [`Release`], which
//! the admission implements: the permits sit above the controller and know the
//! admission by that trait only.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::ask::Kept;

/// What a permit gives back to when dropped.
pub(super) trait Release: Send + Sync + fmt::Debug {
    /// Queued request `id`'s asker went away: it leaves the queue.
    fn abandon(&self, id: u64);
    /// Request `id` ended after `busy` (`completed`: run to completion, so that its
    /// time teaches the cost model).
    fn finish(&self, id: u64, busy: Duration, completed: bool);
    /// A raw read ended after `busy`.
    fn read_done(&self, busy: Duration);
}

/// Removes a queued request whose future was dropped (client gone).
pub(super) struct QueueGuard {
    pub(super) adm: Arc<dyn Release>,
    pub(super) id: u64,
    pub(super) armed: bool,
}

impl Drop for QueueGuard {
    fn drop(&mut self) {
        if self.armed {
            self.adm.abandon(self.id);
        }
    }
}

/// A running request's slot; released (and its time learned) when dropped.
#[derive(Debug)]
pub struct Permit {
    pub(super) adm: Arc<dyn Release>,
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
        self.adm
            .finish(self.id, self.started.elapsed(), self.completed);
    }
}

/// A raw read's slot.
#[derive(Debug)]
pub struct ReadPermit {
    pub(super) adm: Arc<dyn Release>,
    pub(super) started: Instant,
}

impl Drop for ReadPermit {
    fn drop(&mut self) {
        self.adm.read_done(self.started.elapsed());
    }
}
