//! Reading objects: ranged reads of verified bytes (every 64 KiB chunk checked
//! against its CRC32C before a byte is returned), and the read cache of verified
//! ranges ([`ReadCache`]).

use std::sync::atomic::{AtomicU64, Ordering};

use bytes::{Bytes, BytesMut};

use crate::memory::MemoryLedger;

use super::*;

/// Verified bytes of recent reads, by object id and exact range: a column chunk a
/// query reads again (the next query on the same columns, a fragment's other
/// streams) is served from memory, without a device read or a checksum pass. An
/// object replaced gets a new id, so a cached range never outlives its bytes.
pub(super) struct ReadCache {
    pub(super) ranges: moka::sync::Cache<(u64, u64, u64), Bytes>,
    /// The budget its ranges are held in, if any.
    pub(super) ledger: Option<Arc<MemoryLedger>>,
    pub(super) hits: AtomicU64,
    pub(super) misses: AtomicU64,
}

impl ReadCache {
    pub(super) fn capacity(&self) -> u64 {
        self.ranges.policy().max_capacity().unwrap_or(0)
    }
}

/// Largest single device command issued by reads.
const READ_UNIT: u64 = 4 << 20;

impl ObjectStore {
    /// The read cache's figures (all zero when it is off).
    pub fn read_cache_stats(&self) -> ReadCacheStats {
        self.inner
            .read_cache
            .get()
            .map(|c| ReadCacheStats {
                capacity: c.capacity(),
                bytes: {
                    c.ranges.run_pending_tasks();
                    c.ranges.weighted_size()
                },
                hits: c.hits.load(Ordering::Relaxed),
                misses: c.misses.load(Ordering::Relaxed),
            })
            .unwrap_or_default()
    }

    /// Keeps up to `bytes` of recently read, verified object bytes in memory (see
    /// [`ReadCache`]); 0 keeps none. With a `ledger`, the cache is inside its
    /// budget: it keeps a range only if the ledger has room for it, gives the
    /// room back as ranges leave, and lets go of every range when a hold does not
    /// fit ([`MemoryLedger::set_reclaimer`]). Set once, before serving; later
    /// calls are ignored.
    pub fn set_read_cache(&self, bytes: u64, ledger: Option<Arc<MemoryLedger>>) {
        if bytes == 0 {
            return;
        }
        let mut builder = moka::sync::Cache::builder()
            .max_capacity(bytes)
            .weigher(|_, v: &Bytes| u32::try_from(v.len()).unwrap_or(u32::MAX));
        if let Some(l) = ledger.clone() {
            builder = builder.eviction_listener(move |_, v: Bytes, _| l.release(v.len() as u64));
        }
        let ranges = builder.build();
        if let Some(l) = &ledger {
            let kept = ranges.clone();
            l.set_reclaimer(Box::new(move || {
                kept.run_pending_tasks();
                let before = kept.weighted_size();
                kept.invalidate_all();
                kept.run_pending_tasks();
                before
            }));
        }
        let _ = self.inner.read_cache.set(ReadCache {
            ranges,
            ledger,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        });
    }

    /// Reads a whole object.
    pub async fn get_all(&self, name: &str) -> Result<Bytes> {
        let info = self.require(name)?;
        self.read_object_range(&info, 0, info.len).await
    }

    /// Reads `len` bytes at `offset` of `name`, verifying checksums.
    pub async fn read_range(&self, name: &str, offset: u64, len: u64) -> Result<Bytes> {
        let info = self.require(name)?;
        self.read_object_range(&info, offset, len).await
    }

    /// Like [`Self::read_range`] for an object already looked up (it stays readable
    /// while the caller holds it, even if deleted meanwhile).
    pub async fn read_object_range(
        &self,
        info: &Arc<ObjectInfo>,
        offset: u64,
        len: u64,
    ) -> Result<Bytes> {
        let r = self.verified_range(info, offset, len).await;
        if let Err(Error::Corrupt(_)) = &r {
            self.inner.corrupt_reads.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    async fn verified_range(&self, info: &Arc<ObjectInfo>, offset: u64, len: u64) -> Result<Bytes> {
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= info.len)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "range [{offset}, {offset}+{len}) is beyond the end of object {} ({} bytes)",
                    info.name, info.len
                ))
            })?;
        if len == 0 {
            return Ok(Bytes::new());
        }
        let cache = self.inner.read_cache.get();
        let key = (info.id, offset, len);
        if let Some(c) = cache {
            if let Some(b) = c.ranges.get(&key) {
                c.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(b);
            }
            c.misses.fetch_add(1, Ordering::Relaxed);
        }
        let table = self.crc_table(info).await?;
        let chunk = self.inner.sb.chunk_size as u64;
        let first = offset / chunk;
        let last = (end - 1) / chunk;
        let span_start = first * chunk;
        let span_end = ((last + 1) * chunk).min(info.len);
        let bytes = self.read_logical(info, span_start, span_end).await?;
        self.verify_chunks(info, &table, span_start, &bytes)?;
        let out = bytes.slice((offset - span_start) as usize..(end - span_start) as usize);
        // A range larger than a sixteenth of the cache would push out too much. The
        // cache keeps a copy: the slice would hold its whole read buffer.
        if let Some(c) = cache
            && len <= c.capacity() / 16
            && c.ledger.as_ref().is_none_or(|l| l.try_hold(len))
        {
            c.ranges.insert(key, Bytes::copy_from_slice(&out));
        }
        Ok(out)
    }

    /// Checks `bytes`, the object's logical bytes from `span_start` (a chunk
    /// boundary) to a chunk boundary or its end, against its checksum `table`.
    pub(super) fn verify_chunks(
        &self,
        info: &ObjectInfo,
        table: &[u32],
        span_start: u64,
        bytes: &[u8],
    ) -> Result<()> {
        let chunk = self.inner.sb.chunk_size as u64;
        for (i, piece) in bytes.chunks(chunk as usize).enumerate() {
            let at = span_start + i as u64 * chunk;
            let want = table.get((at / chunk) as usize).copied();
            if Some(crc32c::crc32c(piece)) != want {
                return Err(Error::Corrupt(format!(
                    "object {}: checksum mismatch in bytes [{at}, {})",
                    info.name,
                    at + piece.len() as u64
                )));
            }
        }
        Ok(())
    }

    /// Reads logical bytes `[start, end)` (block-aligned start) of an object, unverified.
    pub(super) async fn read_logical(
        &self,
        info: &ObjectInfo,
        start: u64,
        end: u64,
    ) -> Result<Bytes> {
        let bs = self.inner.sb.block_size as u64;
        let first_block = start / bs;
        let last_block = end.div_ceil(bs);
        let mut cmds = Vec::new();
        let mut logical = 0u64;
        for e in &info.extents {
            let (lo, hi) = (logical, logical + e.blocks);
            let (a, b) = (first_block.max(lo), last_block.min(hi));
            let mut x = a;
            while x < b {
                let n = (b - x).min(READ_UNIT / bs);
                cmds.push((e.lba + (x - lo), n));
                x += n;
            }
            logical = hi;
        }
        let dev = &self.inner.dev;
        let reads = cmds
            .iter()
            .map(|&(lba, n)| dev.read(lba, DmaBuf::recycled((n * bs) as usize)));
        let bufs = futures::future::try_join_all(reads)
            .await
            .map_err(|e| unreadable(info, start, end, e))?;
        let want = (end - first_block * bs) as usize;
        if bufs.iter().map(|b| b.len()).sum::<usize>() < want {
            return Err(Error::Corrupt(format!(
                "object {}: extents end before its length",
                info.name
            )));
        }
        if bufs.len() == 1 {
            // One command: the DMA buffer itself backs the bytes (no copy); it returns
            // to the pool when the last slice of it is dropped.
            let only = bufs
                .into_iter()
                .next()
                .ok_or_else(|| Error::Internal("no read buffer".into()))?;
            return Ok(Bytes::from_owner(only).slice(..want));
        }
        let mut out = BytesMut::with_capacity(want);
        for b in &bufs {
            out.extend_from_slice(b);
        }
        out.truncate(want);
        Ok(out.freeze())
    }

    pub(super) async fn crc_table(&self, info: &ObjectInfo) -> Result<Arc<[u32]>> {
        if let Some(t) = lock(&self.inner.crc_tables).get(&info.id) {
            return Ok(t.clone());
        }
        let table = self.crc_table_from_device(info).await?;
        lock(&self.inner.crc_tables).insert(info.id, table.clone());
        Ok(table)
    }

    /// The object's checksum table as the device holds it, checked.
    pub(super) async fn crc_table_from_device(&self, info: &ObjectInfo) -> Result<Arc<[u32]>> {
        let bs = self.inner.sb.block_size as u64;
        let chunks = info.len.div_ceil(self.inner.sb.chunk_size as u64);
        let data_bytes = info.len.div_ceil(bs) * bs;
        let raw = self
            .read_logical(info, data_bytes, data_bytes + chunks * 4)
            .await?;
        if crc32c::crc32c(&raw) != info.table_crc {
            return Err(Error::Corrupt(format!(
                "object {}: checksum table is damaged",
                info.name
            )));
        }
        Ok(raw.chunks_exact(4).map(format::le_u32).collect())
    }
}

/// A device's failure to read an object's bytes, as what it means: those bytes are
/// lost (DATA_LOSS naming the object), unless the failure is not the medium's (a
/// device that lost power, a bad command), which passes as it is.
fn unreadable(info: &ObjectInfo, start: u64, end: u64, e: Error) -> Error {
    match e {
        Error::Io { .. } | Error::Corrupt(_) => Error::Corrupt(format!(
            "object {}: bytes [{start}, {end}) cannot be read from the device ({e})",
            info.name
        )),
        e => e,
    }
}
