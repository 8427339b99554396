//! io_uring backend: O_DIRECT reads and writes on a file or raw block device.
//!
//! One submission thread owns the ring, as an SPDK poller owns a queue pair: callers
//! hand it commands over a channel (waking it through an eventfd that the ring itself
//! is reading), it keeps up to `queue_depth` of them in flight and completes each
//! caller's oneshot. Buffers move into the command, so a caller that stops waiting can
//! never free memory the kernel is still writing into.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, TryRecvError};

use async_trait::async_trait;
use io_uring::{IoUring, opcode, squeue, types};
use tokio::sync::{Semaphore, oneshot};

use super::{
    BlockDevice, DEFAULT_BLOCK_SIZE, DeviceCounters, DeviceStats, DmaBuf, Geometry, check_command,
};
use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug)]
enum Op {
    Read,
    Write,
    Flush,
}

struct Command {
    op: Op,
    offset: u64,
    buf: Option<DmaBuf>,
    done: oneshot::Sender<(std::io::Result<usize>, Option<DmaBuf>)>,
}

/// io_uring + O_DIRECT block device.
pub struct UringDevice {
    geometry: Geometry,
    slots: Semaphore,
    tx: Option<Sender<Command>>,
    wake: Arc<OwnedFd>,
    counters: DeviceCounters,
    thread: Option<std::thread::JoinHandle<()>>,
}

const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

impl UringDevice {
    /// Opens `path` with O_DIRECT. A regular file is created and grown to `capacity`
    /// if needed; a block device keeps its own size.
    pub fn open(path: &Path, capacity: Option<u64>, queue_depth: usize) -> Result<Self> {
        let is_blockdev = std::fs::metadata(path)
            .map(|m| m.file_type().is_block_device())
            .unwrap_or(false);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(!is_blockdev)
            .truncate(false)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .map_err(|e| {
                if e.raw_os_error() == Some(libc::EINVAL) {
                    Error::Unavailable(format!(
                        "{} does not support O_DIRECT (tmpfs?): put the device file on a disk-backed filesystem, \
                         or use --device emulated:file={}",
                        path.display(),
                        path.display()
                    ))
                } else {
                    Error::io(format!("opening device {}", path.display()), e)
                }
            })?;
        let size = if is_blockdev {
            let mut bytes: u64 = 0;
            // SAFETY: BLKGETSIZE64 writes one u64 through the pointer.
            let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut bytes as *mut u64) };
            if rc != 0 {
                return Err(Error::io(
                    format!("reading the size of {}", path.display()),
                    std::io::Error::last_os_error(),
                ));
            }
            bytes
        } else {
            let len = file
                .metadata()
                .map_err(|e| Error::io("stat of device file", e))?
                .len();
            match capacity {
                Some(cap) if cap > len => {
                    file.set_len(cap).map_err(|e| {
                        Error::io(format!("growing {} to {cap} bytes", path.display()), e)
                    })?;
                    cap
                }
                Some(cap) => cap.min(len),
                None if len == 0 => {
                    return Err(Error::InvalidArgument(format!(
                        "{} is empty: give a capacity (--capacity) to create the device file",
                        path.display()
                    )));
                }
                None => len,
            }
        };
        let block_size = DEFAULT_BLOCK_SIZE;
        let num_blocks = size / block_size as u64;
        if num_blocks == 0 {
            return Err(Error::InvalidArgument(format!(
                "{} is smaller than one {block_size}-byte block",
                path.display()
            )));
        }
        let entries = (queue_depth as u32 + 1).next_power_of_two();
        let ring = IoUring::new(entries).map_err(|e| {
            Error::Unavailable(format!(
                "the kernel refused io_uring ({e}); start the node with the fallback backend \
                 --device emulated:file={} (pread/pwrite, no timing model), or allow io_uring \
                 (sysctl kernel.io_uring_disabled=0)",
                path.display()
            ))
        })?;
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
        let thread = std::thread::Builder::new()
            .name(format!(
                "csd-uring-{}",
                path.file_name().and_then(|n| n.to_str()).unwrap_or("dev")
            ))
            .spawn(move || submission_loop(ring, file, rx, thread_wake, queue_depth))
            .map_err(|e| Error::io("starting the io_uring thread", e))?;
        Ok(UringDevice {
            geometry: Geometry {
                name: format!("io_uring:{}", path.display()),
                block_size,
                num_blocks,
                queue_depth,
            },
            slots: Semaphore::new(queue_depth),
            tx: Some(tx),
            wake,
            counters: DeviceCounters::default(),
            thread: Some(thread),
        })
    }

    async fn submit(
        &self,
        op: Op,
        offset: u64,
        buf: Option<DmaBuf>,
    ) -> Result<(usize, Option<DmaBuf>)> {
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
        tx.send(Command {
            op,
            offset,
            buf,
            done,
        })
        .map_err(|_| {
            Error::Internal(format!(
                "{}: the io_uring thread has stopped",
                self.geometry.name
            ))
        })?;
        wake(&self.wake);
        let (res, buf) = rx.await.map_err(|_| {
            Error::Internal(format!(
                "{}: the io_uring thread dropped a command",
                self.geometry.name
            ))
        })?;
        let n = res.map_err(|e| {
            Error::io(
                format!("{op:?} at byte {offset} on {}", self.geometry.name),
                e,
            )
        })?;
        Ok((n, buf))
    }

    async fn rw(&self, op: Op, lba: u64, buf: DmaBuf) -> Result<DmaBuf> {
        check_command(
            &self.geometry,
            if matches!(op, Op::Read) {
                "read"
            } else {
                "write"
            },
            lba,
            &buf,
        )?;
        let len = buf.len();
        let offset = lba * self.geometry.block_size as u64;
        let (n, buf) = self.submit(op, offset, Some(buf)).await?;
        let buf = buf.ok_or_else(|| Error::Internal("io_uring command lost its buffer".into()))?;
        if n != len {
            return Err(Error::io(
                format!("{op:?} at byte {offset} on {}", self.geometry.name),
                std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("short transfer: {n} of {len} bytes"),
                ),
            ));
        }
        Ok(buf)
    }
}

fn wake(fd: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a valid u64 to an eventfd we own. A failure (counter
    // overflow) cannot happen with increments of one, and would only delay a wake-up.
    unsafe { libc::write(fd.as_raw_fd(), &one as *const u64 as *const libc::c_void, 8) };
}

#[async_trait]
impl BlockDevice for UringDevice {
    fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    async fn read(&self, lba: u64, buf: DmaBuf) -> Result<DmaBuf> {
        let len = buf.len();
        let buf = self.rw(Op::Read, lba, buf).await?;
        self.counters.record_read(len);
        Ok(buf)
    }

    async fn write(&self, lba: u64, buf: DmaBuf) -> Result<DmaBuf> {
        let len = buf.len();
        let buf = self.rw(Op::Write, lba, buf).await?;
        self.counters.record_write(len);
        Ok(buf)
    }

    async fn flush(&self) -> Result<()> {
        self.submit(Op::Flush, 0, None).await?;
        self.counters.record_flush();
        Ok(())
    }

    fn stats(&self) -> DeviceStats {
        self.counters.snapshot()
    }
}

impl Drop for UringDevice {
    fn drop(&mut self) {
        self.tx = None;
        wake(&self.wake);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

const WAKE_TOKEN: u64 = u64::MAX;

fn submission_loop(
    mut ring: IoUring,
    file: File,
    rx: Receiver<Command>,
    wake: Arc<OwnedFd>,
    queue_depth: usize,
) {
    let fd: RawFd = file.as_raw_fd();
    let mut wake_buf = Box::new([0u8; 8]);
    let mut slots: Vec<Option<Command>> = (0..queue_depth).map(|_| None).collect();
    let mut free: Vec<usize> = (0..queue_depth).rev().collect();
    let mut disconnected = false;
    let mut wake_armed = false;
    // A flush waits here until every earlier command has completed; meanwhile no new
    // command is taken. (IO_DRAIN cannot be used: it would also wait for the
    // always-pending eventfd read.)
    let mut parked_flush: Option<usize> = None;
    let push = |ring: &mut IoUring, sqe: &squeue::Entry| {
        // SAFETY: every buffer an SQE points to is owned by a command held in `slots`
        // (or is `wake_buf`) until its completion is reaped below.
        while unsafe { ring.submission().push(sqe) }.is_err() {
            if ring.submit().is_err() {
                break;
            }
        }
    };
    loop {
        if !wake_armed && !disconnected {
            let sqe = opcode::Read::new(types::Fd(wake.as_raw_fd()), wake_buf.as_mut_ptr(), 8)
                .build()
                .user_data(WAKE_TOKEN);
            push(&mut ring, &sqe);
            wake_armed = true;
        }
        let busy = queue_depth - free.len();
        if let Some(slot) = parked_flush
            && busy == 1
        {
            push(
                &mut ring,
                &opcode::Fsync::new(types::Fd(fd))
                    .build()
                    .user_data(slot as u64),
            );
            parked_flush = None;
        }
        while parked_flush.is_none() && !free.is_empty() && !disconnected {
            match rx.try_recv() {
                Ok(mut cmd) => {
                    let Some(slot) = free.pop() else { break };
                    let sqe = match (cmd.op, cmd.buf.as_mut()) {
                        (Op::Read, Some(b)) => Some(
                            opcode::Read::new(types::Fd(fd), b.as_mut_ptr(), b.len() as u32)
                                .offset(cmd.offset)
                                .build(),
                        ),
                        (Op::Write, Some(b)) => Some(
                            opcode::Write::new(types::Fd(fd), b.as_mut_ptr(), b.len() as u32)
                                .offset(cmd.offset)
                                .build(),
                        ),
                        _ if queue_depth - free.len() == 1 => {
                            Some(opcode::Fsync::new(types::Fd(fd)).build())
                        }
                        _ => {
                            parked_flush = Some(slot);
                            None
                        }
                    };
                    slots[slot] = Some(cmd);
                    if let Some(sqe) = sqe {
                        push(&mut ring, &sqe.user_data(slot as u64));
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
                for cmd in slots.iter_mut().filter_map(Option::take) {
                    let Command { done, buf, .. } = cmd;
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
            let token = cqe.user_data();
            if token == WAKE_TOKEN {
                wake_armed = false;
                continue;
            }
            let slot = token as usize;
            if let Some(cmd) = slots.get_mut(slot).and_then(Option::take) {
                free.push(slot);
                let res = if cqe.result() < 0 {
                    Err(std::io::Error::from_raw_os_error(-cqe.result()))
                } else {
                    Ok(cqe.result() as usize)
                };
                let _ = cmd.done.send((res, cmd.buf));
            }
        }
    }
}
