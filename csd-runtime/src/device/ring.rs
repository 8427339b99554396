//! The submission thread every io_uring backend shares.
//!
//! One thread owns the ring, as an SPDK poller owns a queue pair: callers hand it
//! commands over a channel (waking it through an eventfd that the ring itself is
//! reading), it keeps up to `queue_depth` of them in flight and completes each caller's
//! oneshot. Buffers move into the command, so a caller that stops waiting can never
//! free memory the kernel is still writing into. What a command becomes on the ring —
//! a `read(2)`-style SQE on a file, or NVMe commands through `IORING_OP_URING_CMD` — is
//! the backend's [`Commands`]; one command may take several SQEs (an NVMe transfer
//! larger than the controller's limit), and completes when the last of them does.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, TryRecvError};

use io_uring::{IoUring, cqueue, opcode, squeue, types};
use tokio::sync::oneshot;

use super::block::DmaBuf;
use super::mailbox::Mailbox;
use crate::error::{Error, Result};

/// What a command asks of the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Op {
    Read,
    Write,
    /// A barrier: sent once every earlier command has completed.
    Flush,
    /// Frees blocks (NVMe Dataset Management); the buffer holds `ranges` ranges.
    Deallocate {
        ranges: u32,
    },
}

/// How a backend turns commands into SQEs and completions into results.
pub(super) trait Commands: Send + 'static {
    /// The SQE size the backend needs.
    type Sqe: squeue::EntryMarker;
    /// The CQE size the backend needs.
    type Cqe: cqueue::EntryMarker;
    /// Appends the SQEs that carry out `op` at byte `offset` with `buf` (none for a
    /// flush). Every SQE pointing into `buf` must stay within it.
    fn build(&self, op: Op, offset: u64, buf: Option<&mut DmaBuf>, out: &mut Vec<Self::Sqe>);
    /// What one SQE's completion says: bytes moved, or why it failed.
    fn complete(&self, cqe: Self::Cqe) -> std::io::Result<usize>;
}

/// The result a command's caller receives, with its buffer back.
pub(super) type Completion = (std::io::Result<usize>, Option<DmaBuf>);

struct Command {
    op: Op,
    offset: u64,
    buf: Option<DmaBuf>,
    done: oneshot::Sender<Completion>,
}

/// A command on the ring: its SQEs not yet completed, bytes so far, the first error.
struct InFlight {
    cmd: Command,
    pending: usize,
    bytes: usize,
    err: Option<std::io::Error>,
}

/// A ring and the thread that drives it.
pub(super) struct Ring {
    mailbox: Mailbox<Command>,
    wake: Arc<OwnedFd>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Ring {
    /// Starts a ring of at least `sq_entries` submission entries, `queue_depth`
    /// commands in flight, its thread named after `name`. `unavailable` words the
    /// error when the kernel refuses io_uring.
    pub(super) fn start<C: Commands>(
        name: String,
        commands: C,
        queue_depth: usize,
        sq_entries: u32,
        unavailable: impl FnOnce(std::io::Error) -> Error,
    ) -> Result<Self> {
        let entries = sq_entries.max(queue_depth as u32 + 1).next_power_of_two();
        let ring = IoUring::<C::Sqe, C::Cqe>::builder()
            .build(entries)
            .map_err(unavailable)?;
        // SAFETY: eventfd returns a fresh descriptor or -1.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if efd < 0 {
            return Err(Error::io(
                "creating an eventfd",
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: efd is a valid descriptor we own.
        let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(efd) });
        let (tx, rx) = std::sync::mpsc::channel();
        let thread_wake = wake.clone();
        let short: String = name
            .rsplit('/')
            .next()
            .unwrap_or("dev")
            .chars()
            .take(10)
            .collect();
        let thread = std::thread::Builder::new()
            .name(format!("csd-ring-{short}"))
            .spawn(move || submission_loop(ring, commands, rx, thread_wake, queue_depth))
            .map_err(|e| Error::io("starting the io_uring thread", e))?;
        Ok(Ring {
            mailbox: Mailbox::new(name, "the io_uring thread", queue_depth, tx),
            wake,
            thread: Some(thread),
        })
    }

    /// Runs one command, waiting for a free slot first.
    pub(super) async fn submit(
        &self,
        op: Op,
        offset: u64,
        buf: Option<DmaBuf>,
    ) -> Result<Completion> {
        self.mailbox
            .call(
                |done| Command {
                    op,
                    offset,
                    buf,
                    done,
                },
                || wake(&self.wake),
            )
            .await
    }
}

fn wake(fd: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a valid u64 to an eventfd we own. A failure (counter
    // overflow) cannot happen with increments of one, and would only delay a wake-up.
    unsafe { libc::write(fd.as_raw_fd(), &one as *const u64 as *const libc::c_void, 8) };
}

impl Drop for Ring {
    fn drop(&mut self) {
        self.mailbox.close();
        wake(&self.wake);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

const WAKE_TOKEN: u64 = u64::MAX;

fn submission_loop<C: Commands>(
    mut ring: IoUring<C::Sqe, C::Cqe>,
    commands: C,
    rx: Receiver<Command>,
    wake: Arc<OwnedFd>,
    queue_depth: usize,
) {
    let mut wake_buf = Box::new([0u8; 8]);
    let mut slots: Vec<Option<InFlight>> = (0..queue_depth).map(|_| None).collect();
    let mut free: Vec<usize> = (0..queue_depth).rev().collect();
    let mut disconnected = false;
    let mut wake_armed = false;
    let mut sqes = Vec::new();
    // A flush waits here until every earlier command has completed; meanwhile no new
    // command is taken. (IO_DRAIN cannot be used: it would also wait for the
    // always-pending eventfd read.)
    let mut parked_flush: Option<usize> = None;
    let push = |ring: &mut IoUring<C::Sqe, C::Cqe>, sqe: &C::Sqe| {
        // SAFETY: every buffer an SQE points to is owned by a command held in `slots`
        // (or is `wake_buf`) until its completion is reaped below.
        while unsafe { ring.submission().push(sqe) }.is_err() {
            if ring.submit().is_err() {
                break;
            }
        }
    };
    // Builds `slot`'s SQEs and puts them on the ring.
    let mut start = |ring: &mut IoUring<C::Sqe, C::Cqe>, f: &mut InFlight, slot: usize| {
        sqes.clear();
        commands.build(f.cmd.op, f.cmd.offset, f.cmd.buf.as_mut(), &mut sqes);
        f.pending = sqes.len();
        for sqe in sqes.drain(..) {
            push(ring, &sqe.user_data_of(slot as u64));
        }
    };
    loop {
        if !wake_armed && !disconnected {
            let sqe = opcode::Read::new(types::Fd(wake.as_raw_fd()), wake_buf.as_mut_ptr(), 8)
                .build()
                .user_data(WAKE_TOKEN);
            push(&mut ring, &C::Sqe::from(sqe));
            wake_armed = true;
        }
        let busy = queue_depth - free.len();
        if let Some(slot) = parked_flush
            && busy == 1
            && let Some(f) = slots[slot].as_mut()
        {
            start(&mut ring, f, slot);
            parked_flush = None;
            if f.pending == 0 {
                finish(&mut slots, &mut free, slot);
            }
        }
        while parked_flush.is_none() && !free.is_empty() && !disconnected {
            match rx.try_recv() {
                Ok(cmd) => {
                    let Some(slot) = free.pop() else { break };
                    let mut f = InFlight {
                        cmd,
                        pending: 0,
                        bytes: 0,
                        err: None,
                    };
                    if f.cmd.op == Op::Flush && queue_depth - free.len() > 1 {
                        parked_flush = Some(slot);
                    } else {
                        start(&mut ring, &mut f, slot);
                    }
                    let finished = f.pending == 0 && parked_flush != Some(slot);
                    slots[slot] = Some(f);
                    if finished {
                        // A command that needed no SQE (nothing to do) completes now.
                        finish(&mut slots, &mut free, slot);
                    }
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => disconnected = true,
            }
        }
        let busy = queue_depth - free.len();
        if disconnected && busy == 0 {
            break;
        }
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e)
                if e.raw_os_error() == Some(libc::EINTR)
                    || e.raw_os_error() == Some(libc::EBUSY) => {}
            Err(e) => {
                // The ring is unusable. Fail every waiting command; buffers the kernel
                // may still touch are leaked rather than freed.
                for f in slots.iter_mut().filter_map(Option::take) {
                    let Command { done, buf, .. } = f.cmd;
                    std::mem::forget(buf);
                    let _ = done.send((
                        Err(std::io::Error::new(
                            e.kind(),
                            format!("io_uring failed: {e}"),
                        )),
                        None,
                    ));
                }
                std::mem::forget(wake_buf);
                return;
            }
        }
        for cqe in ring.completion() {
            let token = cqueue::EntryMarker::user_data(&cqe);
            if token == WAKE_TOKEN {
                wake_armed = false;
                continue;
            }
            let slot = token as usize;
            let Some(f) = slots.get_mut(slot).and_then(Option::as_mut) else {
                continue;
            };
            match commands.complete(cqe) {
                Ok(n) => f.bytes += n,
                Err(e) => {
                    f.err.get_or_insert(e);
                }
            }
            f.pending = f.pending.saturating_sub(1);
            if f.pending == 0 {
                finish(&mut slots, &mut free, slot);
            }
        }
    }
}

/// Hands a command whose SQEs have all completed back to its caller.
fn finish(slots: &mut [Option<InFlight>], free: &mut Vec<usize>, slot: usize) {
    if let Some(f) = slots[slot].take() {
        free.push(slot);
        let res = match f.err {
            Some(e) => Err(e),
            None => Ok(f.bytes),
        };
        let _ = f.cmd.done.send((res, f.cmd.buf));
    }
}

/// Sets an SQE's user data whatever its size.
trait UserData {
    fn user_data_of(self, data: u64) -> Self;
}

impl<S: squeue::EntryMarker> UserData for S {
    fn user_data_of(mut self, data: u64) -> Self {
        self.set_user_data(data);
        self
    }
}
