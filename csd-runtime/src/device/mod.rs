//! NVMe-shaped block devices.
//!
//! One asynchronous trait, [`BlockDevice`]: fixed-size LBA-addressed blocks, aligned
//! DMA-able buffers ([`DmaBuf`]) whose ownership passes to the device for the duration
//! of a command (as with SPDK's `spdk_dma_malloc` buffers and io_uring fixed buffers),
//! asynchronous submit/complete, a bounded queue depth, and a flush barrier.
//!
//! Backends: [`uring::UringDevice`] (io_uring + O_DIRECT over a file or raw block
//! device; the default), [`nvme::NvmeDevice`] (NVMe commands through io_uring
//! passthrough on a namespace's generic character device, `/dev/ngXnY`) and
//! [`emulated::EmulatedDevice`] (memory- or file-backed with a timing model, for tests
//! and the testbed). Pick one from a [`DeviceSpec`].

pub mod emulated;
pub mod faulty;
mod mailbox;
pub mod nvme;
mod ring;
#[cfg(feature = "spdk")]
pub mod spdk;
pub mod uring;

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use async_trait::async_trait;

pub use csd_protocol::size::parse_size;
pub use csd_protocol::stats::{DeviceStats, Geometry};

use crate::error::{Error, Result};

/// Alignment of every [`DmaBuf`]: enough for O_DIRECT on any block device we meet.
pub const DMA_ALIGN: usize = 4096;
/// Default logical block size.
pub(crate) const DEFAULT_BLOCK_SIZE: usize = 4096;

/// A zero-initialised, [`DMA_ALIGN`]-aligned heap buffer. Devices take it by value for
/// the duration of a command and hand it back on completion, so no I/O ever writes
/// into memory the caller still uses.
pub struct DmaBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: DmaBuf owns its allocation exclusively, like a Box<[u8]>.
unsafe impl Send for DmaBuf {}
// SAFETY: shared access only hands out &[u8].
unsafe impl Sync for DmaBuf {}

/// Buffers of at most this size are recycled through [`BUF_POOL`].
const POOL_MAX_BUF: usize = 4 << 20;
/// Bytes the pool may hold idle, at most (a node lowers it to fit its budget:
/// [`limit_idle_buffers`]).
const POOL_MAX_BYTES: usize = 64 << 20;

/// Bytes the pool may hold idle now.
static POOL_LIMIT: AtomicUsize = AtomicUsize::new(POOL_MAX_BYTES);

/// Lets the pool of idle DMA buffers hold at most `bytes` (never more than it
/// allowed before: a process's nodes share the pool, and the smallest budget's
/// share bounds it), freeing what it holds beyond that now.
pub fn limit_idle_buffers(bytes: usize) {
    POOL_LIMIT.fetch_min(bytes, Ordering::Relaxed);
    release_idle_buffers_above(POOL_LIMIT.load(Ordering::Relaxed));
}

/// Frees idle DMA buffers until the pool keeps at most `keep` bytes.
fn release_idle_buffers_above(keep: usize) {
    let mut freed = Vec::new();
    {
        let mut pool = BUF_POOL.lock().unwrap_or_else(|p| p.into_inner());
        let Some(p) = pool.as_mut() else { return };
        for (&len, addrs) in p.idle.iter_mut() {
            while p.bytes > keep
                && let Some(addr) = addrs.pop()
            {
                p.bytes -= len;
                freed.push((addr, len));
            }
        }
    }
    for (addr, len) in freed {
        // SAFETY: the pool owned this allocation of exactly `len` bytes (taken over
        // from a DmaBuf in Drop) and has just given it up.
        unsafe { std::alloc::dealloc(addr as *mut u8, DmaBuf::layout(len)) }
    }
}

/// Recycled DMA buffers by size, like SPDK's DMA-safe mempools: reads allocate a buffer
/// per command, and fresh allocations of this size are mmap + page faults + zeroing.
struct BufPool {
    idle: std::collections::HashMap<usize, Vec<usize>>,
    bytes: usize,
}

static BUF_POOL: std::sync::Mutex<Option<BufPool>> = std::sync::Mutex::new(None);

impl DmaBuf {
    /// A buffer whose every byte the caller or device will overwrite (a read target, a
    /// staging buffer): recycled when one of
    /// this size is idle (its bytes are then stale, not zero), else freshly zeroed.
    pub fn recycled(len: usize) -> Self {
        if len > 0 && len <= POOL_MAX_BUF {
            let mut pool = BUF_POOL.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(p) = pool.as_mut()
                && let Some(addr) = p.idle.get_mut(&len).and_then(Vec::pop)
            {
                p.bytes -= len;
                // SAFETY: addr came from a live DmaBuf allocation of exactly `len` bytes
                // whose ownership the pool took over in Drop.
                return DmaBuf {
                    ptr: unsafe { NonNull::new_unchecked(addr as *mut u8) },
                    len,
                };
            }
        }
        Self::zeroed(len)
    }

    /// Allocates `len` zeroed bytes aligned to [`DMA_ALIGN`]. `len` may be any size;
    /// devices require a multiple of their block size.
    pub fn zeroed(len: usize) -> Self {
        let layout = Self::layout(len);
        // SAFETY: layout has a non-zero size (len.max(1)).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(ptr) else {
            std::alloc::handle_alloc_error(layout)
        };
        DmaBuf { ptr, len }
    }

    /// A buffer holding a copy of `bytes`.
    pub fn from_slice(bytes: &[u8]) -> Self {
        let mut b = Self::recycled(bytes.len());
        b.copy_from_slice(bytes);
        b
    }

    fn layout(len: usize) -> Layout {
        // Only fails for sizes near isize::MAX, which no caller can allocate anyway.
        Layout::from_size_align(len.max(1), DMA_ALIGN)
            .unwrap_or_else(|_| panic!("DmaBuf of {len} bytes is too large"))
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Raw pointer for handing to the kernel.
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        if self.len > 0 && self.len <= POOL_MAX_BUF {
            let mut pool = BUF_POOL.lock().unwrap_or_else(|p| p.into_inner());
            let p = pool.get_or_insert_with(|| BufPool {
                idle: Default::default(),
                bytes: 0,
            });
            if p.bytes + self.len <= POOL_LIMIT.load(Ordering::Relaxed) {
                p.bytes += self.len;
                p.idle
                    .entry(self.len)
                    .or_default()
                    .push(self.ptr.as_ptr() as usize);
                return;
            }
        }
        // SAFETY: allocated in `zeroed` with this exact layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

impl AsRef<[u8]> for DmaBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl std::ops::Deref for DmaBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised bytes, owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for DmaBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl fmt::Debug for DmaBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DmaBuf({} bytes)", self.len)
    }
}

/// Counters every backend keeps.
#[derive(Debug, Default)]
pub(crate) struct DeviceCounters {
    reads: AtomicU64,
    writes: AtomicU64,
    flushes: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    bytes_deallocated: AtomicU64,
    retried: AtomicU64,
}

impl DeviceCounters {
    pub(crate) fn record_read(&self, bytes: usize) {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.bytes_read.fetch_add(bytes as u64, Ordering::Relaxed);
    }
    pub(crate) fn record_write(&self, bytes: usize) {
        self.writes.fetch_add(1, Ordering::Relaxed);
        self.bytes_written
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }
    pub(crate) fn record_deallocate(&self, bytes: u64) {
        self.bytes_deallocated.fetch_add(bytes, Ordering::Relaxed);
    }
    pub(crate) fn record_flush(&self) {
        self.flushes.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn record_retry(&self) {
        self.retried.fetch_add(1, Ordering::Relaxed);
    }
    /// Current values.
    pub(crate) fn snapshot(&self) -> DeviceStats {
        DeviceStats {
            reads: self.reads.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
            flushes: self.flushes.load(Ordering::Relaxed),
            bytes_read: self.bytes_read.load(Ordering::Relaxed),
            bytes_written: self.bytes_written.load(Ordering::Relaxed),
            bytes_deallocated: self.bytes_deallocated.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
        }
    }
}

/// An NVMe-shaped block device.
///
/// Commands address whole logical blocks; buffers must be [`DmaBuf`]s whose length is a
/// non-zero multiple of the block size. At most `queue_depth` commands are in flight;
/// further submissions wait for a slot. Completion order is unspecified.
#[async_trait]
pub trait BlockDevice: Send + Sync + 'static {
    /// The device's shape.
    fn geometry(&self) -> &Geometry;

    /// Reads `buf.len() / block_size` blocks starting at `lba` into `buf`.
    async fn read(&self, lba: u64, buf: DmaBuf) -> Result<DmaBuf>;

    /// Writes `buf` to the blocks starting at `lba`. Returns the buffer for reuse.
    async fn write(&self, lba: u64, buf: DmaBuf) -> Result<DmaBuf>;

    /// Barrier: completes after every write submitted before it has completed and is
    /// durable (fsync / NVMe Flush after draining the queue).
    async fn flush(&self) -> Result<()>;

    /// Command counters.
    fn stats(&self) -> DeviceStats;

    /// True when [`deallocate`](Self::deallocate) tells the device something (NVMe
    /// Dataset Management); the store then frees blocks through it.
    fn can_deallocate(&self) -> bool {
        false
    }

    /// Tells the device that `blocks` blocks from `lba` hold nothing worth keeping.
    /// Reading them afterwards may return anything. The default does nothing.
    async fn deallocate(&self, _lba: u64, _blocks: u64) -> Result<()> {
        Ok(())
    }
}

/// Checks a command against the device's rules before it is submitted.
pub(crate) fn check_command(geo: &Geometry, op: &str, lba: u64, buf: &DmaBuf) -> Result<u64> {
    let bs = geo.block_size;
    if buf.is_empty() || !buf.len().is_multiple_of(bs) {
        return Err(Error::InvalidArgument(format!(
            "{op} of {} bytes on {}: length must be a non-zero multiple of the {bs}-byte block size",
            buf.len(),
            geo.name
        )));
    }
    let blocks = (buf.len() / bs) as u64;
    match lba.checked_add(blocks) {
        Some(end) if end <= geo.num_blocks => Ok(blocks),
        _ => Err(Error::InvalidArgument(format!(
            "{op} of blocks [{lba}, {lba}+{blocks}) on {}: beyond the last block {}",
            geo.name,
            geo.num_blocks.saturating_sub(1)
        ))),
    }
}

/// How to open a device, parsed from `--device`:
///
/// * `PATH` or `uring:PATH` – io_uring with O_DIRECT on a file (created or grown to
///   `--capacity`) or a raw block device such as `/dev/nvme0n1`.
/// * `nvme:PATH` – NVMe commands through io_uring passthrough on a namespace's generic
///   character device (`/dev/ngXnY`); a plain path of that name means the same.
/// * `spdk:malloc=MIB`, `spdk:tcp=HOST:PORT/NQN`, `spdk:pcie=BDF` – an SPDK bdev
///   (builds with the `spdk` feature only).
/// * `emulated:mem[,opts]` or `emulated:file=PATH[,opts]` – emulated NVMe, with
///   `latency_us`, `read_mbps`, `write_mbps`, `queue_depth`, `parallelism` options.
///   A model with no options is untimed (plain memory or pread/pwrite): the fallback
///   where the kernel refuses io_uring.
/// * `faulty:SEED[,RATE=P…][,safe_below=LBA]:INNER` – any of the above, misbehaving
///   on purpose and deterministically for `SEED` ([`faulty`]): rates `rot`,
///   `corrupt`, `misdirect`, `lse`, `write_eio`, `enospc`, `flush_fail`, `spike`
///   (probabilities), `spike_ms`; no silent faults below block `safe_below`.
#[derive(Debug, Clone, PartialEq)]
pub enum DeviceSpec {
    /// io_uring on a file or raw block device.
    Uring {
        /// The file or device path.
        path: std::path::PathBuf,
    },
    /// NVMe passthrough on a namespace's generic character device.
    Nvme {
        /// `/dev/ngXnY`.
        path: std::path::PathBuf,
    },
    /// An SPDK bdev (what follows `spdk:`).
    Spdk {
        /// `malloc=MIB`, `tcp=HOST:PORT/NQN` or `pcie=BDF`.
        target: String,
    },
    /// Another device, misbehaving on purpose.
    Faulty {
        /// The faults' seed.
        seed: u64,
        /// How often each fault happens.
        rates: faulty::FaultRates,
        /// No silent faults below this block.
        safe_below: u64,
        /// The device underneath.
        inner: Box<DeviceSpec>,
    },
    /// Emulated NVMe.
    Emulated {
        /// `None` for memory-backed.
        path: Option<std::path::PathBuf>,
        /// Timing model.
        model: emulated::TimingModel,
    },
}

impl FromStr for DeviceSpec {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: String| Error::InvalidArgument(format!("device spec {s:?}: {why}"));
        if let Some(rest) = s.strip_prefix("faulty:") {
            let (head, inner) = rest
                .split_once(':')
                .ok_or_else(|| bad("expected faulty:SEED[,RATE=P…]:INNER_SPEC".into()))?;
            let mut parts = head.split(',');
            let seed = parts.next().unwrap_or_default();
            let seed = seed
                .parse::<u64>()
                .map_err(|_| bad(format!("seed {seed:?} is not a number")))?;
            let (mut rates, mut safe_below) = (faulty::FaultRates::default(), 0);
            for opt in parts {
                let (k, v) = opt
                    .split_once('=')
                    .ok_or_else(|| bad(format!("option {opt:?} is not key=value")))?;
                let v = v
                    .parse::<f64>()
                    .map_err(|_| bad(format!("option {k}: {v:?} is not a number")))?;
                if k == "safe_below" {
                    safe_below = v as u64;
                } else if !rates.set(k, v) {
                    return Err(bad(format!(
                        "unknown option {k:?} (known: {}, safe_below)",
                        faulty::FaultRates::KEYS
                    )));
                }
            }
            rates.validate().map_err(|e| bad(e.to_string()))?;
            return Ok(DeviceSpec::Faulty {
                seed,
                rates,
                safe_below,
                inner: Box::new(inner.parse()?),
            });
        }
        if let Some(rest) = s.strip_prefix("emulated:") {
            let mut parts = rest.split(',');
            let target = parts.next().unwrap_or_default();
            let path = if target == "mem" {
                None
            } else if let Some(p) = target.strip_prefix("file=") {
                Some(std::path::PathBuf::from(p))
            } else {
                return Err(bad(
                    "expected `emulated:mem` or `emulated:file=PATH` before the options".into(),
                ));
            };
            let mut model = emulated::TimingModel::untimed();
            for opt in parts {
                let (k, v) = opt
                    .split_once('=')
                    .ok_or_else(|| bad(format!("option {opt:?} is not key=value")))?;
                let num = |v: &str| {
                    v.parse::<f64>()
                        .map_err(|_| bad(format!("option {k}: {v:?} is not a number")))
                };
                match k {
                    "latency_us" => model.latency_us = num(v)?,
                    "read_mbps" => model.read_mbps = num(v)?,
                    "write_mbps" => model.write_mbps = num(v)?,
                    "queue_depth" => model.queue_depth = num(v)? as usize,
                    "parallelism" => model.parallelism = num(v)? as usize,
                    _ => {
                        return Err(bad(format!(
                            "unknown option {k:?} (known: latency_us, read_mbps, write_mbps, queue_depth, parallelism)"
                        )));
                    }
                }
            }
            model.validate().map_err(|e| bad(e.to_string()))?;
            return Ok(DeviceSpec::Emulated { path, model });
        }
        if let Some(target) = s.strip_prefix("spdk:") {
            #[cfg(feature = "spdk")]
            spdk::SpdkTarget::parse(target)?;
            return Ok(DeviceSpec::Spdk {
                target: target.into(),
            });
        }
        if let Some(path) = s.strip_prefix("nvme:") {
            if path.is_empty() {
                return Err(bad("empty path".into()));
            }
            return Ok(DeviceSpec::Nvme { path: path.into() });
        }
        let path = s.strip_prefix("uring:").unwrap_or(s);
        if path.is_empty() {
            return Err(bad("empty path".into()));
        }
        if s == path && is_nvme_generic_name(path) {
            return Ok(DeviceSpec::Nvme { path: path.into() });
        }
        Ok(DeviceSpec::Uring { path: path.into() })
    }
}

/// True for `/dev/ngXnY`, the name the kernel gives a namespace's generic device.
fn is_nvme_generic_name(path: &str) -> bool {
    let Some(rest) = path.strip_prefix("/dev/ng") else {
        return false;
    };
    let Some((ctrl, ns)) = rest.split_once('n') else {
        return false;
    };
    let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    digits(ctrl) && digits(ns)
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Uring { path } => write!(f, "uring:{}", path.display()),
            DeviceSpec::Nvme { path } => write!(f, "nvme:{}", path.display()),
            DeviceSpec::Spdk { target } => write!(f, "spdk:{target}"),
            DeviceSpec::Faulty {
                seed,
                rates,
                safe_below,
                inner,
            } => write!(f, "faulty:{seed}{rates},safe_below={safe_below}:{inner}"),
            DeviceSpec::Emulated { path, model } => {
                match path {
                    None => write!(f, "emulated:mem")?,
                    Some(p) => write!(f, "emulated:file={}", p.display())?,
                }
                write!(
                    f,
                    ",latency_us={},read_mbps={},write_mbps={},queue_depth={},parallelism={}",
                    model.latency_us,
                    model.read_mbps,
                    model.write_mbps,
                    model.queue_depth,
                    model.parallelism
                )
            }
        }
    }
}

impl DeviceSpec {
    /// Opens the device. `capacity` sizes new files and memory devices; an existing raw
    /// device or file keeps its size when `capacity` is `None`.
    pub fn open(&self, capacity: Option<u64>) -> Result<Arc<dyn BlockDevice>> {
        match self {
            DeviceSpec::Uring { path } => {
                Ok(Arc::new(uring::UringDevice::open(path, capacity, 64)?))
            }
            DeviceSpec::Nvme { path } => Ok(Arc::new(nvme::NvmeDevice::open(path, 64)?)),
            DeviceSpec::Faulty {
                seed,
                rates,
                safe_below,
                inner,
            } => {
                let disk = faulty::FaultyDisk::new(inner.open(capacity)?, *seed, rates.clone())?;
                disk.set_safe_below(*safe_below);
                Ok(disk.device())
            }
            #[cfg(feature = "spdk")]
            DeviceSpec::Spdk { target } => Ok(Arc::new(spdk::SpdkDevice::open(
                &spdk::SpdkTarget::parse(target)?,
                64,
            )?)),
            #[cfg(not(feature = "spdk"))]
            DeviceSpec::Spdk { target } => Err(Error::Unimplemented(format!(
                "device spdk:{target}: this csd was built without SPDK (build SPDK with \
                 scripts/build-spdk.sh, then cargo build --release --features spdk with SPDK_DIR set)"
            ))),
            DeviceSpec::Emulated { path, model } => {
                let cap = capacity.or_else(|| {
                    path.as_ref()
                        .and_then(|p| std::fs::metadata(p).ok())
                        .map(|m| m.len())
                });
                let cap = cap.ok_or_else(|| {
                    Error::InvalidArgument("an emulated device needs a capacity".into())
                })?;
                Ok(Arc::new(emulated::EmulatedDevice::open(
                    path.as_deref(),
                    cap,
                    DEFAULT_BLOCK_SIZE,
                    model.clone(),
                )?))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs() {
        assert_eq!(
            "/tmp/x".parse::<DeviceSpec>().unwrap(),
            DeviceSpec::Uring {
                path: "/tmp/x".into()
            }
        );
        let DeviceSpec::Emulated { path, model } =
            "emulated:mem,latency_us=80,read_mbps=2000,parallelism=4"
                .parse()
                .unwrap()
        else {
            panic!("not emulated")
        };
        assert!(path.is_none());
        assert_eq!(
            (model.latency_us, model.read_mbps, model.parallelism),
            (80.0, 2000.0, 4)
        );
        let e = "emulated:mem,speed=3"
            .parse::<DeviceSpec>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown option \"speed\""), "{e}");
        assert!("emulated:disk".parse::<DeviceSpec>().is_err());
        for (spec, nvme) in [
            ("nvme:/dev/ng0n1", true),
            ("/dev/ng12n3", true),
            ("uring:/dev/ng0n1", false),
            ("/dev/nvme0n1", false),
            ("/dev/ngx", false),
            ("/dev/ng0n", false),
        ] {
            let parsed = spec.parse::<DeviceSpec>().unwrap();
            assert_eq!(matches!(parsed, DeviceSpec::Nvme { .. }), nvme, "{spec}");
        }
        assert!("nvme:".parse::<DeviceSpec>().is_err());
        // A faulty device over another spec, round-tripping through its text.
        let spec = "faulty:42,rot=0.001,flush_fail=0.01,safe_below=129:emulated:mem"
            .parse::<DeviceSpec>()
            .unwrap();
        let DeviceSpec::Faulty {
            seed,
            rates,
            safe_below,
            inner,
        } = &spec
        else {
            panic!("not faulty: {spec:?}")
        };
        assert_eq!(
            (*seed, rates.rot, rates.flush_fail, *safe_below),
            (42, 0.001, 0.01, 129)
        );
        assert!(matches!(**inner, DeviceSpec::Emulated { path: None, .. }));
        assert_eq!(spec.to_string().parse::<DeviceSpec>().unwrap(), spec);
        assert!(spec.open(Some(1 << 20)).is_ok());
        for bad in [
            "faulty:x:emulated:mem",
            "faulty:1,rot=2:emulated:mem",
            "faulty:1,wobble=0.1:emulated:mem",
            "faulty:1",
        ] {
            assert!(bad.parse::<DeviceSpec>().is_err(), "{bad}");
        }
        assert!(
            "emulated:mem,latency_us=fast"
                .parse::<DeviceSpec>()
                .is_err()
        );
    }

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("2g").unwrap(), 2 << 30);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("3 parsecs").is_err());
    }

    #[test]
    fn dma_buf_is_aligned_and_zeroed() {
        let mut b = DmaBuf::zeroed(8192);
        assert_eq!(b.as_mut_ptr() as usize % DMA_ALIGN, 0);
        assert!(b.iter().all(|&x| x == 0));
    }
}
