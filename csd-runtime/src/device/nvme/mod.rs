//! NVMe passthrough: NVMe Read, Write, Flush and Dataset Management commands sent
//! through io_uring (`IORING_OP_URING_CMD`, kernel 5.19 or newer) to a namespace's
//! generic character device `/dev/ngXnY`, past the block layer — the kernel's answer
//! to SPDK's user-space queue pairs, without giving the device up.
//!
//! The device is identified once at open (namespace size and LBA format, the
//! controller's transfer limit, whether it deallocates and has a write cache). The
//! store's blocks are 4 KiB; namespaces formatted with 512-byte (or any smaller power
//! of two) LBAs are addressed in runs of LBAs. Transfers larger than the controller
//! takes in one command go out as several commands of one request. A command that
//! ends with an NVMe status maps to the store's errors ([`status`]): a media error is
//! `DATA_LOSS` naming the byte range.

mod command;
pub mod identify;
pub mod status;

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;

use async_trait::async_trait;
use io_uring::{cqueue, opcode, squeue, types};

use self::command::{DSM_MAX_RANGES, DSM_RANGE_BYTES, NvmeCmd, URING_CMD_IO};
use self::identify::{ControllerInfo, NamespaceInfo};
use self::status::NvmeStatus;
use super::block::{BlockDevice, DEFAULT_BLOCK_SIZE, DeviceCounters, DmaBuf, check_command};
use super::ring::{Commands, Op, Ring};
use crate::error::{Error, Result};
use csd_protocol::stats::{DeviceStats, Geometry};

/// Largest transfer sent as one command when the controller sets no limit.
const DEFAULT_MAX_TRANSFER: usize = 1 << 20;

/// What Identify said when the device was opened.
#[derive(Clone, Debug)]
pub struct NvmeInfo {
    /// The namespace id of the opened device.
    pub nsid: u32,
    /// The controller.
    pub controller: ControllerInfo,
    /// The namespace.
    pub namespace: NamespaceInfo,
    /// Bytes one command moves at most (the controller's and the kernel's limits).
    pub max_transfer: usize,
}

/// A namespace driven by NVMe commands through io_uring passthrough.
pub struct NvmeDevice {
    geometry: Geometry,
    info: NvmeInfo,
    ring: Ring,
    counters: DeviceCounters,
}

/// NVMe commands on the ring.
struct NvmeCommands {
    /// Kept open for as long as the ring thread runs.
    file: File,
    nsid: u32,
    /// log2 of the LBA size.
    lba_shift: u32,
    max_transfer: usize,
}

impl NvmeCommands {
    fn sqe(&self, cmd: NvmeCmd) -> squeue::Entry128 {
        opcode::UringCmd80::new(types::Fd(self.file.as_raw_fd()), URING_CMD_IO)
            .cmd(cmd.to_sqe_bytes())
            .build()
    }
}

impl Commands for NvmeCommands {
    type Sqe = squeue::Entry128;
    type Cqe = cqueue::Entry32;

    fn build(&self, op: Op, offset: u64, buf: Option<&mut DmaBuf>, out: &mut Vec<Self::Sqe>) {
        match (op, buf) {
            (Op::Read | Op::Write, Some(b)) => {
                let base = b.as_mut_ptr() as u64;
                let mut at = 0;
                while at < b.len() {
                    let len = self.max_transfer.min(b.len() - at);
                    let slba = (offset + at as u64) >> self.lba_shift;
                    let nlb = (len >> self.lba_shift) as u32;
                    out.push(self.sqe(NvmeCmd::rw(
                        op == Op::Write,
                        self.nsid,
                        slba,
                        nlb,
                        base + at as u64,
                        len as u32,
                    )));
                    at += len;
                }
            }
            (Op::Deallocate { ranges }, Some(b)) => out.push(self.sqe(NvmeCmd::deallocate(
                self.nsid,
                ranges,
                b.as_mut_ptr() as u64,
            ))),
            _ => out.push(self.sqe(NvmeCmd::flush(self.nsid))),
        }
    }

    fn complete(&self, cqe: cqueue::Entry32) -> std::io::Result<usize> {
        let res = cqe.result();
        match res {
            0 => Ok(0),
            r if r < 0 => Err(std::io::Error::from_raw_os_error(-r)),
            r => Err(std::io::Error::other(NvmeStatus(r as u16))),
        }
    }
}

/// Times a command interrupted in the kernel is sent again.
const RETRIES: usize = 4;

/// Sends one admin command through the ioctl (Identify: a few per open).
fn admin(file: &File, cmd: &mut NvmeCmd) -> std::io::Result<()> {
    // SAFETY: the ioctl reads and writes one `struct nvme_admin_cmd` (72 bytes, our
    // repr(C) NvmeCmd) and transfers `data_len` bytes at `addr`, which the caller
    // points at a live buffer of that size.
    let rc = unsafe {
        libc::ioctl(
            file.as_raw_fd(),
            command::IOCTL_ADMIN_CMD,
            cmd as *mut NvmeCmd,
        )
    };
    match rc {
        0 => Ok(()),
        r if r < 0 => Err(std::io::Error::last_os_error()),
        r => Err(std::io::Error::other(NvmeStatus(r as u16))),
    }
}

fn identify(file: &File, nsid: u32, cns: u32) -> std::io::Result<Box<[u8; 4096]>> {
    let mut buf = DmaBuf::zeroed(4096);
    let mut cmd = NvmeCmd::identify(nsid, cns, buf.as_mut_ptr() as u64);
    admin(file, &mut cmd)?;
    let mut out = Box::new([0u8; 4096]);
    out.copy_from_slice(&buf);
    Ok(out)
}

/// The kernel's own transfer limit for the namespace (its block queue's limits),
/// where sysfs shows them.
fn kernel_max_transfer(path: &Path) -> Option<usize> {
    let name = path.file_name()?.to_str()?;
    let block = format!("nvme{}", name.strip_prefix("ng")?);
    let read = |f: &str| -> Option<usize> {
        std::fs::read_to_string(format!("/sys/block/{block}/queue/{f}"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    let hw = read("max_hw_sectors_kb").map(|kb| kb << 10);
    // Our buffers are contiguous in virtual memory only: a page per segment.
    let segs = read("max_segments").map(|s| s * 4096);
    match (hw, segs) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

impl NvmeDevice {
    /// Opens the generic character device of an NVMe namespace (`/dev/ngXnY`),
    /// identifies it, and starts its ring with `queue_depth` commands in flight.
    pub fn open(path: &Path, queue_depth: usize) -> Result<Self> {
        let shown = path.display();
        let meta = std::fs::metadata(path)
            .map_err(|e| Error::io(format!("opening NVMe device {shown}"), e))?;
        if !meta.file_type().is_char_device() {
            return Err(Error::InvalidArgument(format!(
                "{shown} is not a character device: NVMe passthrough needs a namespace's generic \
                 device (/dev/ngXnY); for a file or block device use --device uring:{shown}"
            )));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| Error::io(format!("opening NVMe device {shown}"), e))?;
        // SAFETY: NVME_IOCTL_ID takes no argument and returns the namespace id.
        let nsid = unsafe { libc::ioctl(file.as_raw_fd(), command::IOCTL_ID) };
        if nsid <= 0 {
            return Err(Error::InvalidArgument(format!(
                "{shown} is not an NVMe namespace (NVME_IOCTL_ID: {})",
                std::io::Error::last_os_error()
            )));
        }
        let nsid = nsid as u32;
        let refused = |what: &str, e: std::io::Error| match e.raw_os_error() {
            Some(libc::EACCES) | Some(libc::EPERM) => Error::PermissionDenied(format!(
                "{what} on {shown} was refused ({e}): NVMe admin commands need CAP_SYS_ADMIN"
            )),
            _ => Error::io(format!("{what} on {shown}"), e),
        };
        let controller = ControllerInfo::parse(
            &*identify(&file, 0, command::CNS_CONTROLLER)
                .map_err(|e| refused("Identify Controller", e))?,
        );
        let namespace = NamespaceInfo::parse(
            &*identify(&file, nsid, command::CNS_NAMESPACE)
                .map_err(|e| refused("Identify Namespace", e))?,
        )
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{shown}: namespace {nsid} is inactive or reports no usable LBA format"
            ))
        })?;
        let lba = namespace.lba_bytes as usize;
        if lba > DEFAULT_BLOCK_SIZE || namespace.metadata_bytes != 0 || namespace.protection {
            return Err(Error::Unimplemented(format!(
                "{shown} is formatted with {lba}-byte LBAs and {} metadata bytes per block{}: \
                 csd drives namespaces with LBAs of at most {DEFAULT_BLOCK_SIZE} bytes and no \
                 metadata or protection information (reformat, e.g. `nvme format --lbaf=N`)",
                namespace.metadata_bytes,
                if namespace.protection {
                    " with protection information"
                } else {
                    ""
                }
            )));
        }
        let mut max_transfer = controller.max_transfer().unwrap_or(DEFAULT_MAX_TRANSFER);
        if let Some(k) = kernel_max_transfer(path) {
            max_transfer = max_transfer.min(k);
        }
        // NLB is a 16-bit field: at most 65536 LBAs a command.
        let max_transfer = max_transfer.min(lba << 16);
        let max_transfer = (max_transfer / DEFAULT_BLOCK_SIZE).max(1) * DEFAULT_BLOCK_SIZE;
        let bytes = namespace.blocks * lba as u64;
        let num_blocks = bytes / DEFAULT_BLOCK_SIZE as u64;
        if num_blocks == 0 {
            return Err(Error::InvalidArgument(format!(
                "{shown} is smaller than one {DEFAULT_BLOCK_SIZE}-byte block"
            )));
        }
        let info = NvmeInfo {
            nsid,
            controller,
            namespace,
            max_transfer,
        };
        let name = format!("nvme:{shown}");
        let commands = NvmeCommands {
            file,
            nsid,
            lba_shift: lba.trailing_zeros(),
            max_transfer,
        };
        let ring = Ring::start(
            name.clone(),
            commands,
            queue_depth,
            // A command of a few MiB becomes several NVMe commands.
            (queue_depth * 4) as u32,
            |e| {
                Error::Unavailable(format!(
                    "the kernel refused an io_uring with 128-byte entries for {shown} ({e}): NVMe \
                     passthrough needs Linux 5.19 or newer with io_uring allowed; use \
                     --device uring:/dev/nvme{} (the block device) instead",
                    shown.to_string().trim_start_matches("/dev/ng")
                ))
            },
        )?;
        Ok(NvmeDevice {
            geometry: Geometry {
                name,
                block_size: DEFAULT_BLOCK_SIZE,
                num_blocks,
                queue_depth,
            },
            info,
            ring,
            counters: DeviceCounters::default(),
        })
    }

    /// What Identify said.
    pub fn info(&self) -> &NvmeInfo {
        &self.info
    }

    /// Runs one command, mapping an NVMe status for `what` (the operation and range).
    /// A command the kernel gave up on before the controller answered (EINTR: its
    /// wait for a free request was interrupted; EAGAIN) is sent again, a few times:
    /// reads and writes of the same bytes are idempotent.
    async fn run(
        &self,
        op: Op,
        offset: u64,
        mut buf: Option<DmaBuf>,
        what: impl Fn() -> String,
    ) -> Result<Option<DmaBuf>> {
        let mut tries = 0;
        let (res, buf) = loop {
            let (res, back) = self.ring.submit(op, offset, buf).await?;
            let again = matches!(&res, Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN)));
            if !again || tries == RETRIES {
                break (res, back);
            }
            tries += 1;
            self.counters.record_retry();
            tracing::debug!(
                ?op,
                offset,
                tries,
                "NVMe command interrupted in the kernel; sending it again"
            );
            buf = back;
        };
        match res {
            Ok(_) => Ok(buf),
            Err(e) => Err(
                match e.get_ref().and_then(|i| i.downcast_ref::<NvmeStatus>()) {
                    Some(s) => s.to_error(matches!(op, Op::Read), what()),
                    None => Error::io(what(), e),
                },
            ),
        }
    }

    async fn rw(&self, write: bool, lba: u64, buf: DmaBuf) -> Result<DmaBuf> {
        let name = if write { "write" } else { "read" };
        check_command(&self.geometry, name, lba, &buf)?;
        let offset = lba * DEFAULT_BLOCK_SIZE as u64;
        let len = buf.len() as u64;
        let op = if write { Op::Write } else { Op::Read };
        self.run(op, offset, Some(buf), || {
            format!(
                "{name} of bytes [{offset}, {}) on {}",
                offset + len,
                self.geometry.name
            )
        })
        .await?
        .ok_or_else(|| Error::Internal("an NVMe command lost its buffer".into()))
    }
}

#[async_trait]
impl BlockDevice for NvmeDevice {
    fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    async fn read(&self, lba: u64, buf: DmaBuf) -> Result<DmaBuf> {
        let len = buf.len();
        let buf = self.rw(false, lba, buf).await?;
        self.counters.record_read(len);
        Ok(buf)
    }

    async fn write(&self, lba: u64, buf: DmaBuf) -> Result<DmaBuf> {
        let len = buf.len();
        let buf = self.rw(true, lba, buf).await?;
        self.counters.record_write(len);
        Ok(buf)
    }

    async fn flush(&self) -> Result<()> {
        self.run(Op::Flush, 0, None, || {
            format!("flush of {}", self.geometry.name)
        })
        .await?;
        self.counters.record_flush();
        Ok(())
    }

    fn stats(&self) -> DeviceStats {
        self.counters.snapshot()
    }

    fn can_deallocate(&self) -> bool {
        self.info.controller.dataset_management
    }

    async fn deallocate(&self, lba: u64, blocks: u64) -> Result<()> {
        if !self.can_deallocate() || blocks == 0 {
            return Ok(());
        }
        let g = &self.geometry;
        if lba.checked_add(blocks).is_none_or(|end| end > g.num_blocks) {
            return Err(Error::InvalidArgument(format!(
                "deallocate of blocks [{lba}, {lba}+{blocks}) on {}: beyond the last block",
                g.name
            )));
        }
        // Store blocks to LBAs, in ranges of at most u32::MAX LBAs, 256 per command.
        let per_block = (DEFAULT_BLOCK_SIZE as u64) / self.info.namespace.lba_bytes as u64;
        let (mut slba, end) = (lba * per_block, (lba + blocks) * per_block);
        while slba < end {
            let mut buf = DmaBuf::zeroed(DSM_MAX_RANGES * DSM_RANGE_BYTES);
            let mut ranges = 0;
            while slba < end && ranges < DSM_MAX_RANGES {
                let nlb = (end - slba).min(u32::MAX as u64) as u32;
                let at = ranges * DSM_RANGE_BYTES;
                command::put_range(&mut buf[at..at + DSM_RANGE_BYTES], slba, nlb);
                slba += nlb as u64;
                ranges += 1;
            }
            self.run(
                Op::Deallocate {
                    ranges: ranges as u32,
                },
                0,
                Some(buf),
                || {
                    format!(
                        "deallocate of blocks [{lba}, {}) on {}",
                        lba + blocks,
                        g.name
                    )
                },
            )
            .await?;
        }
        self.counters
            .record_deallocate(blocks * DEFAULT_BLOCK_SIZE as u64);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_transfer_beyond_the_limit_becomes_several_commands() {
        let c = NvmeCommands {
            file: File::open("/dev/null").unwrap(),
            nsid: 1,
            lba_shift: 9,
            max_transfer: 1 << 20,
        };
        let mut out = Vec::new();
        let mut buf = DmaBuf::zeroed((5 << 20) / 2);
        c.build(Op::Read, 4096, Some(&mut buf), &mut out);
        assert_eq!(out.len(), 3, "2.5 MiB in 1 MiB commands");
        out.clear();
        c.build(Op::Write, 0, Some(&mut DmaBuf::zeroed(4096)), &mut out);
        c.build(Op::Flush, 0, None, &mut out);
        c.build(
            Op::Deallocate { ranges: 1 },
            0,
            Some(&mut DmaBuf::zeroed(4096)),
            &mut out,
        );
        assert_eq!(out.len(), 3);
    }
}
