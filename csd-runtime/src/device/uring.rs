//! io_uring backend: O_DIRECT reads and writes on a file or raw block device.
//!
//! The ring and its thread are [`super::ring`]'s; this backend's commands are plain
//! reads and writes at an offset, and `fsync` for a flush.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use async_trait::async_trait;
use io_uring::{cqueue, opcode, squeue, types};

use super::block::{BlockDevice, DEFAULT_BLOCK_SIZE, DeviceCounters, DmaBuf, check_command};
use super::ring::{Commands, Op, Ring};
use crate::error::{Error, Result};
use csd_protocol::stats::{DeviceStats, Geometry};

/// Plain file I/O on the ring.
struct FileCommands {
    /// Kept open for as long as the ring thread runs.
    file: File,
}

impl Commands for FileCommands {
    type Sqe = squeue::Entry;
    type Cqe = cqueue::Entry;

    fn build(&self, op: Op, offset: u64, buf: Option<&mut DmaBuf>, out: &mut Vec<squeue::Entry>) {
        let fd = types::Fd(self.file.as_raw_fd() as RawFd);
        out.push(match (op, buf) {
            (Op::Read, Some(b)) => opcode::Read::new(fd, b.as_mut_ptr(), b.len() as u32)
                .offset(offset)
                .build(),
            (Op::Write, Some(b)) => opcode::Write::new(fd, b.as_mut_ptr(), b.len() as u32)
                .offset(offset)
                .build(),
            // Files keep freed blocks: nothing to send.
            (Op::Deallocate { .. }, _) => return,
            _ => opcode::Fsync::new(fd).build(),
        });
    }

    fn complete(&self, cqe: cqueue::Entry) -> std::io::Result<usize> {
        if cqe.result() < 0 {
            Err(std::io::Error::from_raw_os_error(-cqe.result()))
        } else {
            Ok(cqe.result() as usize)
        }
    }
}

/// io_uring + O_DIRECT block device.
pub struct UringDevice {
    geometry: Geometry,
    ring: Ring,
    counters: DeviceCounters,
}

const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

impl UringDevice {
    /// Opens `path` with O_DIRECT. A regular file is created and grown to `capacity`
    /// if needed; a block device keeps its own size.
    pub fn open(path: &Path, capacity: Option<u64>, queue_depth: usize) -> Result<Self> {
        let kind = std::fs::metadata(path).map(|m| m.file_type()).ok();
        if kind.is_some_and(|k| k.is_char_device()) {
            return Err(Error::InvalidArgument(format!(
                "{} is a character device: for an NVMe generic device (/dev/ngXnY) use \
                 --device nvme:{}",
                path.display(),
                path.display()
            )));
        }
        let is_blockdev = kind.is_some_and(|k| k.is_block_device());
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
        let name = format!("io_uring:{}", path.display());
        let ring = Ring::start(
            name.clone(),
            FileCommands { file },
            queue_depth,
            queue_depth as u32 + 1,
            |e| {
                Error::Unavailable(format!(
                    "the kernel refused io_uring ({e}); start the node with the fallback backend \
                     --device emulated:file={} (pread/pwrite, no timing model), or allow io_uring \
                     (sysctl kernel.io_uring_disabled=0)",
                    path.display()
                ))
            },
        )?;
        Ok(UringDevice {
            geometry: Geometry {
                name,
                block_size,
                num_blocks,
                queue_depth,
            },
            ring,
            counters: DeviceCounters::default(),
        })
    }

    async fn submit(
        &self,
        op: Op,
        offset: u64,
        buf: Option<DmaBuf>,
    ) -> Result<(usize, Option<DmaBuf>)> {
        let (res, buf) = self.ring.submit(op, offset, buf).await?;
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
