//! How async callers hand commands to a device's own thread (the io_uring
//! submission thread, SPDK's poller): at most `queue_depth` in flight, each command
//! carrying the oneshot its answer comes back on. Closing the mailbox tells the
//! thread to finish what it has and stop.

use std::sync::mpsc::Sender;

use tokio::sync::{Semaphore, oneshot};

use crate::error::{Error, Result};

/// The sending side of a device thread's command channel.
pub(super) struct Mailbox<C> {
    /// The device, for errors.
    name: String,
    /// What the thread is, for errors ("the io_uring thread").
    thread: &'static str,
    slots: Semaphore,
    tx: Option<Sender<C>>,
}

impl<C> Mailbox<C> {
    pub(super) fn new(
        name: String,
        thread: &'static str,
        queue_depth: usize,
        tx: Sender<C>,
    ) -> Self {
        Mailbox {
            name,
            thread,
            slots: Semaphore::new(queue_depth),
            tx: Some(tx),
        }
    }

    /// Waits for a free slot, sends the command `make` builds around its answer's
    /// channel, calls `sent` (to wake the thread), and waits for the answer.
    pub(super) async fn call<R>(
        &self,
        make: impl FnOnce(oneshot::Sender<R>) -> C,
        sent: impl FnOnce(),
    ) -> Result<R> {
        let _slot = self
            .slots
            .acquire()
            .await
            .map_err(|_| Error::Internal("device closed".into()))?;
        let (done, rx) = oneshot::channel();
        let tx = self
            .tx
            .as_ref()
            .ok_or_else(|| Error::Internal("device closed".into()))?;
        tx.send(make(done))
            .map_err(|_| Error::Internal(format!("{}: {} has stopped", self.name, self.thread)))?;
        sent();
        rx.await.map_err(|_| {
            Error::Internal(format!("{}: {} dropped a command", self.name, self.thread))
        })
    }

    /// Closes the channel: the thread ends once it has answered what it holds.
    pub(super) fn close(&mut self) {
        self.tx = None;
    }
}
