//! The device contract: [`BlockDevice`], the aligned buffers commands own
//! ([`DmaBuf`], pooled), the counters every backend keeps and the checks every
//! command passes.

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use async_trait::async_trait;
use csd_protocol::stats::{DeviceStats, Geometry};

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
