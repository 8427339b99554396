//! A crash-safe object store on raw blocks, in the spirit of SPDK's blobstore.
//!
//! * Named objects; names group into tables and partitions by `/` (`lineitem/p0/000001.parquet`).
//! * Extent allocation from a free map rebuilt from the catalog at open.
//! * CRC32C per `chunk_size` bytes (64 KiB default), verified on every read: a
//!   mismatch is an [`Error::Corrupt`] naming the object and byte range, never bytes.
//! * Crash-atomic put, replace and delete: data is written to free extents and
//!   flushed, then the whole catalog is written to one catalog slot and flushed, then
//!   to the other and flushed; only then is the change acknowledged. A torn catalog
//!   write fails its checksum and open uses the other slot, so after a kill at any
//!   instant each object is whole or absent; and since every acknowledged catalog is
//!   in both slots, corruption of one slot loses nothing (open says so, and rewrites
//!   it from the other). Extents of deleted or replaced objects are reused only after the commit
//!   that dropped them, and only once no reader still holds the object.
//! * Ranged reads, for Parquet footers and column chunks.
//!
//! Invariant: every extent in the data region belongs to at most one committed
//! object, and the allocator never hands out a block a committed object uses.

pub mod alloc;
mod format;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use bytes::{Bytes, BytesMut};
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use prost::Message;
use serde::{Deserialize, Serialize};

use crate::device::{BlockDevice, DmaBuf};
use crate::error::{Error, Result};
use alloc::Allocator;
pub use alloc::Extent;
pub use csd_protocol::stats::{ReadCacheStats, StoreStats};
use format::{
    CatalogProto, ExtentProto, ObjectProto, SLOT_HEADER, Superblock, decode_slot_header,
    encode_slot_header,
};

/// What to do when the device holds no store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FormatMode {
    /// Format a blank (zeroed) device; refuse one holding foreign data.
    #[default]
    IfBlank,
    /// Never format: fail if no store is found.
    Never,
    /// Erase whatever is there and format.
    Force,
}

/// Options for opening a store.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Format policy.
    pub format: FormatMode,
    /// Checksum granularity for new stores (multiple of the block size).
    pub chunk_size: u32,
    /// Catalog slot size in blocks for new stores (0 = derive from capacity).
    pub slot_blocks: u64,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            format: FormatMode::IfBlank,
            chunk_size: 64 * 1024,
            slot_blocks: 0,
        }
    }
}

/// A committed object.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ObjectInfo {
    /// Full name.
    pub name: String,
    /// Stable id (changes when the object is replaced).
    pub id: u64,
    /// Length in bytes.
    pub len: u64,
    /// Extents holding data and CRC table.
    pub extents: Vec<Extent>,
    /// Creation time, ms since the Unix epoch.
    pub created_unix_ms: u64,
    #[serde(skip)]
    table_crc: u32,
}

impl ObjectInfo {
    /// As the `objects` action lists it.
    pub fn entry(&self) -> csd_protocol::messages::ObjectEntry {
        csd_protocol::messages::ObjectEntry {
            name: self.name.clone(),
            id: self.id,
            len: self.len,
            extents: self.extents.clone(),
            created_unix_ms: self.created_unix_ms,
        }
    }
}

/// Verified bytes of recent reads, by object id and exact range: a column chunk a
/// query reads again (the next query on the same columns, a fragment's other
/// streams) is served from memory, without a device read or a checksum pass. An
/// object replaced gets a new id, so a cached range never outlives its bytes.
struct ReadCache {
    ranges: moka::sync::Cache<(u64, u64, u64), Bytes>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl ReadCache {
    fn capacity(&self) -> u64 {
        self.ranges.policy().max_capacity().unwrap_or(0)
    }
}

/// Objects are staged in memory and written in units of this many bytes.
const WRITE_UNIT: usize = 1 << 20;
/// Writes in flight per object writer.
const WRITES_IN_FLIGHT: usize = 4;
/// Largest single device command issued by reads.
const READ_UNIT: u64 = 4 << 20;

struct CommitState {
    generation: u64,
    live_slot: usize,
    catalog_bytes: usize,
}

struct Inner {
    dev: Arc<dyn BlockDevice>,
    sb: Superblock,
    objects: RwLock<BTreeMap<String, Arc<ObjectInfo>>>,
    alloc: Mutex<Allocator>,
    /// Extents of objects dropped from the catalog, freed once no reader holds them.
    dropped: Mutex<Vec<Arc<ObjectInfo>>>,
    /// Extents of abandoned writers, freed after the next flush barrier (their
    /// writes may still be in the device queue).
    quarantine: Mutex<Vec<Extent>>,
    crc_tables: Mutex<HashMap<u64, Arc<[u32]>>>,
    commit: tokio::sync::Mutex<CommitState>,
    next_id: Mutex<u64>,
    /// Set when a catalog write failed: the on-disk state is then uncertain until
    /// reopened, so the store refuses further changes.
    failed: AtomicBool,
    read_cache: std::sync::OnceLock<ReadCache>,
}

/// The object store. Cheap to clone.
#[derive(Clone)]
pub struct ObjectStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ObjectStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ObjectStore({})", self.inner.dev.geometry().name)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Object names: 1..=512 bytes of `[A-Za-z0-9._=-]` in `/`-separated parts, none empty,
/// `.` or `..`.
pub(crate) fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 512
        && name.split('/').all(|p| {
            !p.is_empty()
                && p != "."
                && p != ".."
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._=-".contains(&b))
        });
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "object name {:?} is invalid: use 1-512 characters of A-Z a-z 0-9 . _ = - in /-separated parts",
            crate::error::truncated(name)
        )))
    }
}

impl ObjectStore {
    /// Opens the store on `dev`, formatting it as `opts.format` allows.
    pub async fn open(dev: Arc<dyn BlockDevice>, opts: StoreOptions) -> Result<Self> {
        let geo = dev.geometry().clone();
        let bs = geo.block_size;
        let block0 = dev.read(0, DmaBuf::zeroed(bs)).await?;
        let found = match Superblock::decode(&block0) {
            Ok(sb) if opts.format != FormatMode::Force => sb,
            Err(e) if opts.format != FormatMode::Force => return Err(e),
            _ => None,
        };
        let sb = match found {
            Some(sb) => {
                if sb.block_size as usize != bs || sb.num_blocks > geo.num_blocks {
                    return Err(Error::InvalidArgument(format!(
                        "store was formatted for {} blocks of {} bytes; device {} has {} blocks of {bs}",
                        sb.num_blocks, sb.block_size, geo.name, geo.num_blocks
                    )));
                }
                sb
            }
            None if opts.format == FormatMode::Never => {
                return Err(Error::NotFound(format!("no object store on {}", geo.name)));
            }
            None => Self::format(dev.as_ref(), &opts).await?,
        };
        let (generation, live_slot, catalog, catalog_bytes) =
            Self::load_catalog(dev.as_ref(), &sb).await?;
        Self::mirror_catalog(dev.as_ref(), &sb, generation, live_slot, &catalog).await?;
        let mut alloc = Allocator::new(sb.data_start(), sb.num_blocks);
        let mut objects = BTreeMap::new();
        for o in catalog.objects {
            let info = ObjectInfo {
                extents: o.extents.iter().map(|&e| e.into()).collect(),
                name: o.name,
                id: o.id,
                len: o.len,
                created_unix_ms: o.created_unix_ms,
                table_crc: o.table_crc,
            };
            validate_name(&info.name).map_err(|_| {
                Error::Corrupt(format!("catalog holds an invalid name {:?}", info.name))
            })?;
            let want = Self::total_blocks_for(&sb, info.len);
            let have: u64 = info.extents.iter().map(|e| e.blocks).sum();
            if want != have {
                return Err(Error::Corrupt(format!(
                    "object {}: extents hold {have} blocks, expected {want}",
                    info.name
                )));
            }
            for e in &info.extents {
                alloc
                    .reserve(*e)
                    .map_err(|err| Error::Corrupt(format!("object {}: {err}", info.name)))?;
            }
            objects.insert(info.name.clone(), Arc::new(info));
        }
        Ok(ObjectStore {
            inner: Arc::new(Inner {
                dev,
                sb,
                objects: RwLock::new(objects),
                alloc: Mutex::new(alloc),
                dropped: Mutex::new(Vec::new()),
                quarantine: Mutex::new(Vec::new()),
                crc_tables: Mutex::new(HashMap::new()),
                commit: tokio::sync::Mutex::new(CommitState {
                    generation,
                    live_slot,
                    catalog_bytes,
                }),
                next_id: Mutex::new(catalog.next_id.max(1)),
                failed: AtomicBool::new(false),
                read_cache: std::sync::OnceLock::new(),
            }),
        })
    }

    async fn format(dev: &dyn BlockDevice, opts: &StoreOptions) -> Result<Superblock> {
        let geo = dev.geometry();
        let bs = geo.block_size as u64;
        if opts.chunk_size == 0
            || !(opts.chunk_size as u64).is_multiple_of(bs)
            || !(WRITE_UNIT as u64).is_multiple_of(opts.chunk_size as u64)
        {
            return Err(Error::InvalidArgument(format!(
                "checksum chunk size {} must be a multiple of the block size {bs} dividing {WRITE_UNIT}",
                opts.chunk_size
            )));
        }
        let slot_blocks = if opts.slot_blocks > 0 {
            opts.slot_blocks
        } else {
            (geo.num_blocks / 256).clamp(64, 16384)
        };
        if 1 + 2 * slot_blocks + 16 > geo.num_blocks {
            return Err(Error::InvalidArgument(format!(
                "device {} ({} blocks) is too small for a store with {slot_blocks}-block catalog slots",
                geo.name, geo.num_blocks
            )));
        }
        let sb = Superblock {
            block_size: bs as u32,
            num_blocks: geo.num_blocks,
            slot_blocks,
            chunk_size: opts.chunk_size,
        };
        // Erase the superblock first, so a crash mid-format leaves a blank device
        // rather than an old superblock over new slots.
        dev.write(0, DmaBuf::zeroed(bs as usize)).await?;
        dev.flush().await?;
        let empty = CatalogProto {
            objects: vec![],
            next_id: 1,
        }
        .encode_to_vec();
        // Both slots hold the first catalog, as they hold every later one: opening a
        // fresh store finds nothing to repair.
        for slot in 0..2 {
            let mut b = DmaBuf::zeroed(bs as usize);
            encode_slot_header(&mut b, 1, &empty);
            b[SLOT_HEADER..SLOT_HEADER + empty.len()].copy_from_slice(&empty);
            dev.write(sb.slot_lba(slot), b).await?;
        }
        dev.flush().await?;
        let mut b = DmaBuf::zeroed(bs as usize);
        sb.encode(&mut b);
        dev.write(0, b).await?;
        dev.flush().await?;
        tracing::info!(device = %geo.name, blocks = geo.num_blocks, slot_blocks, "formatted object store");
        Ok(sb)
    }

    async fn read_slot(
        dev: &dyn BlockDevice,
        sb: &Superblock,
        slot: usize,
    ) -> Result<Option<(u64, CatalogProto, usize)>> {
        let bs = sb.block_size as usize;
        let head = dev.read(sb.slot_lba(slot), DmaBuf::zeroed(bs)).await?;
        let Some((generation, len, crc)) = decode_slot_header(&head) else {
            return Ok(None);
        };
        let total = SLOT_HEADER as u64 + len;
        if total > sb.slot_bytes() as u64 {
            return Ok(None);
        }
        let blocks = total.div_ceil(bs as u64) as usize;
        let buf = if blocks == 1 {
            head
        } else {
            dev.read(sb.slot_lba(slot), DmaBuf::zeroed(blocks * bs))
                .await?
        };
        let payload = &buf[SLOT_HEADER..SLOT_HEADER + len as usize];
        if crc32c::crc32c(payload) != crc {
            return Ok(None);
        }
        match CatalogProto::decode(payload) {
            Ok(c) => Ok(Some((generation, c, len as usize))),
            Err(_) => Ok(None),
        }
    }

    /// Makes the slot other than `live` a copy of the live catalog, when it is not
    /// already (a torn last commit, or a slot corrupted at rest), and says so.
    async fn mirror_catalog(
        dev: &dyn BlockDevice,
        sb: &Superblock,
        generation: u64,
        live: usize,
        catalog: &CatalogProto,
    ) -> Result<()> {
        let other = 1 - live;
        match Self::read_slot(dev, sb, other).await? {
            Some((g, ..)) if g == generation => return Ok(()),
            Some((g, ..)) => tracing::warn!(
                device = %dev.geometry().name,
                "catalog slot {other} holds generation {g}, slot {live} generation {generation}: \
                 the last commit was cut short; copying generation {generation} into slot {other}"
            ),
            None => tracing::warn!(
                device = %dev.geometry().name,
                "catalog slot {other} is not readable (torn or corrupt); slot {live} holds \
                 generation {generation}; rewriting slot {other} from it"
            ),
        }
        let bytes = catalog.encode_to_vec();
        let bs = sb.block_size as usize;
        let mut buf = DmaBuf::zeroed((SLOT_HEADER + bytes.len()).div_ceil(bs) * bs);
        encode_slot_header(&mut buf, generation, &bytes);
        buf[SLOT_HEADER..SLOT_HEADER + bytes.len()].copy_from_slice(&bytes);
        dev.write(sb.slot_lba(other), buf).await?;
        dev.flush().await
    }

    async fn load_catalog(
        dev: &dyn BlockDevice,
        sb: &Superblock,
    ) -> Result<(u64, usize, CatalogProto, usize)> {
        let a = Self::read_slot(dev, sb, 0).await?;
        let b = Self::read_slot(dev, sb, 1).await?;
        let pick = match (a, b) {
            (Some(a), Some(b)) if b.0 > a.0 => (1, b),
            (Some(a), _) => (0, a),
            (None, Some(b)) => (1, b),
            (None, None) => {
                return Err(Error::Corrupt(format!(
                    "{}: neither catalog slot holds a valid catalog",
                    dev.geometry().name
                )));
            }
        };
        let (slot, (generation, catalog, bytes)) = pick;
        Ok((generation, slot, catalog, bytes))
    }

    fn total_blocks_for(sb: &Superblock, len: u64) -> u64 {
        let bs = sb.block_size as u64;
        let chunks = len.div_ceil(sb.chunk_size as u64);
        len.div_ceil(bs) + (chunks * 4).div_ceil(bs)
    }

    /// The device under the store.
    pub fn device(&self) -> &Arc<dyn BlockDevice> {
        &self.inner.dev
    }

    /// Looks an object up.
    pub fn get(&self, name: &str) -> Option<Arc<ObjectInfo>> {
        self.inner
            .objects
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned()
    }

    fn require(&self, name: &str) -> Result<Arc<ObjectInfo>> {
        self.get(name)
            .ok_or_else(|| Error::NotFound(format!("object {}", crate::error::truncated(name))))
    }

    /// Objects whose names start with `prefix`, in name order.
    pub fn list(&self, prefix: &str) -> Vec<Arc<ObjectInfo>> {
        let objects = self.inner.objects.read().unwrap_or_else(|p| p.into_inner());
        objects
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Current figures.
    pub async fn stats(&self) -> StoreStats {
        let (objects, bytes_stored) = {
            let o = self.inner.objects.read().unwrap_or_else(|p| p.into_inner());
            (o.len(), o.values().map(|x| x.len).sum())
        };
        let (free_blocks, free_runs) = {
            let mut a = lock(&self.inner.alloc);
            self.reclaim(&mut a);
            (a.free_blocks(), a.free_runs())
        };
        let abandoned_blocks = lock(&self.inner.quarantine).iter().map(|e| e.blocks).sum();
        let c = self.inner.commit.lock().await;
        let sb = &self.inner.sb;
        StoreStats {
            objects,
            bytes_stored,
            data_blocks: sb.num_blocks - sb.data_start(),
            free_blocks,
            free_runs,
            abandoned_blocks,
            block_size: sb.block_size,
            chunk_size: sb.chunk_size,
            catalog_generation: c.generation,
            catalog_bytes: c.catalog_bytes,
            catalog_capacity: sb.slot_bytes() - SLOT_HEADER,
            read_cache: self.read_cache_stats(),
        }
    }

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
    /// [`ReadCache`]); 0 keeps none. Set once, before serving; later calls are
    /// ignored.
    pub fn set_read_cache(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let ranges = moka::sync::Cache::builder()
            .max_capacity(bytes)
            .weigher(|_, v: &Bytes| u32::try_from(v.len()).unwrap_or(u32::MAX))
            .build();
        let _ = self.inner.read_cache.set(ReadCache {
            ranges,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        });
    }

    fn check_writable(&self) -> Result<()> {
        if self.inner.failed.load(Ordering::Acquire) {
            return Err(Error::Unavailable(
                "an earlier catalog write failed; the store is read-only until the node restarts"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Starts writing object `name`. It becomes visible, replacing any object of that
    /// name, only when [`ObjectWriter::finish`] returns.
    pub fn create(&self, name: &str) -> Result<ObjectWriter> {
        validate_name(name)?;
        self.check_writable()?;
        let id = {
            let mut n = lock(&self.inner.next_id);
            let id = *n;
            *n += 1;
            id
        };
        Ok(ObjectWriter {
            store: self.clone(),
            name: name.to_string(),
            id,
            extents: Vec::new(),
            staging: DmaBuf::recycled(WRITE_UNIT),
            fill: 0,
            len: 0,
            crcs: Vec::new(),
            inflight: FuturesUnordered::new(),
            done: false,
        })
    }

    /// Stores `data` as `name` in one call.
    pub async fn put(&self, name: &str, data: &[u8]) -> Result<Arc<ObjectInfo>> {
        let mut w = self.create(name)?;
        w.write(data).await?;
        w.finish().await
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
        for k in first..=last {
            let a = (k * chunk - span_start) as usize;
            let b = (((k + 1) * chunk).min(info.len) - span_start) as usize;
            let want = table.get(k as usize).copied();
            if Some(crc32c::crc32c(&bytes[a..b])) != want {
                return Err(Error::Corrupt(format!(
                    "object {}: checksum mismatch in bytes [{}, {})",
                    info.name,
                    k * chunk,
                    k * chunk + (b - a) as u64
                )));
            }
        }
        let out = bytes.slice((offset - span_start) as usize..(end - span_start) as usize);
        // A range larger than a sixteenth of the cache would push out too much.
        if let Some(c) = cache
            && len <= c.capacity() / 16
        {
            c.ranges.insert(key, out.clone());
        }
        Ok(out)
    }

    /// Reads logical bytes `[start, end)` (block-aligned start) of an object, unverified.
    async fn read_logical(&self, info: &ObjectInfo, start: u64, end: u64) -> Result<Bytes> {
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
        let bufs = futures::future::try_join_all(reads).await?;
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

    async fn crc_table(&self, info: &ObjectInfo) -> Result<Arc<[u32]>> {
        if let Some(t) = lock(&self.inner.crc_tables).get(&info.id) {
            return Ok(t.clone());
        }
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
        let table: Arc<[u32]> = raw.chunks_exact(4).map(format::le_u32).collect();
        lock(&self.inner.crc_tables).insert(info.id, table.clone());
        Ok(table)
    }

    /// Deletes one object. Space is reused once readers holding it are done.
    pub async fn delete(&self, name: &str) -> Result<Arc<ObjectInfo>> {
        let name = name.to_string();
        let mut gone = self
            .commit_change(|objects| Ok(objects.remove(&name).into_iter().collect()))
            .await?;
        gone.pop()
            .ok_or_else(|| Error::NotFound(format!("object {}", crate::error::truncated(&name))))
    }

    /// Deletes every object whose name starts with `prefix`, atomically.
    pub async fn delete_prefix(&self, prefix: &str) -> Result<Vec<Arc<ObjectInfo>>> {
        let prefix = prefix.to_string();
        self.commit_change(|objects| {
            let names: Vec<String> = objects
                .keys()
                .filter(|k| k.starts_with(&prefix))
                .cloned()
                .collect();
            Ok(names
                .into_iter()
                .filter_map(|n| objects.remove(&n))
                .collect())
        })
        .await
    }

    /// Applies `change` to a copy of the catalog, commits it, then installs it.
    /// Returns the objects the change dropped.
    async fn commit_change(
        &self,
        change: impl FnOnce(&mut BTreeMap<String, Arc<ObjectInfo>>) -> Result<Vec<Arc<ObjectInfo>>>,
    ) -> Result<Vec<Arc<ObjectInfo>>> {
        self.check_writable()?;
        let inner = &self.inner;
        let mut c = inner.commit.lock().await;
        let mut next = inner
            .objects
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let dropped = change(&mut next)?;
        let catalog = CatalogProto {
            objects: next
                .values()
                .map(|o| ObjectProto {
                    name: o.name.clone(),
                    id: o.id,
                    len: o.len,
                    extents: o.extents.iter().map(|&e| ExtentProto::from(e)).collect(),
                    table_crc: o.table_crc,
                    created_unix_ms: o.created_unix_ms,
                })
                .collect(),
            next_id: *lock(&inner.next_id),
        }
        .encode_to_vec();
        let capacity = inner.sb.slot_bytes() - SLOT_HEADER;
        if catalog.len() > capacity {
            return Err(Error::ResourcesExhausted(format!(
                "the object catalog is full ({} objects need {} bytes; a slot holds {capacity}): delete objects, \
                 or reformat with larger catalog slots",
                next.len(),
                catalog.len()
            )));
        }
        let quarantined = std::mem::take(&mut *lock(&inner.quarantine));
        // Barrier: all object data (and any abandoned writer's stray writes) is on the
        // device before the catalog that references it.
        inner.dev.flush().await?;
        let bs = inner.sb.block_size as usize;
        let blocks = (SLOT_HEADER + catalog.len()).div_ceil(bs);
        let mut buf = DmaBuf::zeroed(blocks * bs);
        let generation = c.generation + 1;
        encode_slot_header(&mut buf, generation, &catalog);
        buf[SLOT_HEADER..SLOT_HEADER + catalog.len()].copy_from_slice(&catalog);
        // The slot not holding the live catalog first: should this write tear, the
        // other still holds the last acknowledged one. Then the mirror.
        let slot = 1 - c.live_slot;
        let mirror = DmaBuf::from_slice(&buf);
        let written = async {
            inner.dev.write(inner.sb.slot_lba(slot), buf).await?;
            inner.dev.flush().await?;
            inner.dev.write(inner.sb.slot_lba(1 - slot), mirror).await?;
            inner.dev.flush().await
        }
        .await;
        if let Err(e) = written {
            inner.failed.store(true, Ordering::Release);
            lock(&inner.quarantine).extend(quarantined);
            return Err(e);
        }
        c.generation = generation;
        c.live_slot = slot;
        c.catalog_bytes = catalog.len();
        *inner.objects.write().unwrap_or_else(|p| p.into_inner()) = next;
        {
            let mut a = lock(&inner.alloc);
            for e in quarantined {
                a.free(e);
            }
        }
        let mut crc = lock(&inner.crc_tables);
        for d in &dropped {
            crc.remove(&d.id);
        }
        drop(crc);
        lock(&inner.dropped).extend(dropped.iter().cloned());
        Ok(dropped)
    }

    /// Frees the extents of dropped objects that no reader holds any more.
    fn reclaim(&self, a: &mut Allocator) {
        lock(&self.inner.dropped).retain(|o| {
            if Arc::strong_count(o) == 1 {
                o.extents.iter().for_each(|&e| a.free(e));
                false
            } else {
                true
            }
        });
    }

    /// Returns the blocks of abandoned writers (uploads whose client went away) to
    /// the free map now, after a flush barrier so that none of their writes is still
    /// queued; returns how many blocks came back.
    pub(crate) async fn release_abandoned(&self) -> Result<u64> {
        let inner = &self.inner;
        let taken = std::mem::take(&mut *lock(&inner.quarantine));
        if taken.is_empty() {
            return Ok(0);
        }
        if let Err(e) = inner.dev.flush().await {
            lock(&inner.quarantine).extend(taken);
            return Err(e);
        }
        let mut a = lock(&inner.alloc);
        let blocks = taken.iter().map(|e| e.blocks).sum();
        for e in taken {
            a.free(e);
        }
        Ok(blocks)
    }

    fn allocate(&self, blocks: u64, hint: Option<u64>) -> Result<Vec<Extent>> {
        let mut a = lock(&self.inner.alloc);
        self.reclaim(&mut a);
        a.allocate(blocks, hint)
    }
}

/// Streams one object onto the device. Dropping it unfinished abandons the object;
/// its blocks return to the free map after a flush barrier, at once when dropped
/// inside a tokio runtime (else at the next commit).
pub struct ObjectWriter {
    store: ObjectStore,
    name: String,
    id: u64,
    extents: Vec<Extent>,
    staging: DmaBuf,
    fill: usize,
    len: u64,
    crcs: Vec<u32>,
    inflight: FuturesUnordered<BoxFuture<'static, Result<()>>>,
    done: bool,
}

impl ObjectWriter {
    /// Bytes written so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True before anything is written.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends `data`.
    pub async fn write(&mut self, mut data: &[u8]) -> Result<()> {
        while !data.is_empty() {
            let n = (WRITE_UNIT - self.fill).min(data.len());
            self.staging[self.fill..self.fill + n].copy_from_slice(&data[..n]);
            self.fill += n;
            self.len += n as u64;
            data = &data[n..];
            if self.fill == WRITE_UNIT {
                self.flush_staging().await?;
            }
        }
        Ok(())
    }

    /// Checksums the staged bytes and writes them (padded to a block) to new extents.
    async fn flush_staging(&mut self) -> Result<()> {
        if self.fill == 0 {
            return Ok(());
        }
        let chunk = self.store.inner.sb.chunk_size as usize;
        for c in self.staging[..self.fill].chunks(chunk) {
            self.crcs.push(crc32c::crc32c(c));
        }
        let bs = self.store.inner.sb.block_size as usize;
        let padded = self.fill.div_ceil(bs) * bs;
        let mut buf = std::mem::replace(&mut self.staging, DmaBuf::recycled(WRITE_UNIT));
        if padded < buf.len() {
            buf[self.fill..padded].fill(0);
            let mut small = DmaBuf::zeroed(padded);
            small.copy_from_slice(&buf[..padded]);
            buf = small;
        }
        self.fill = 0;
        self.write_blocks(buf).await
    }

    async fn write_blocks(&mut self, buf: DmaBuf) -> Result<()> {
        let bs = self.store.inner.sb.block_size as usize;
        let blocks = (buf.len() / bs) as u64;
        let hint = self.extents.last().map(|e| e.end());
        let got = match self.store.allocate(blocks, hint) {
            // Abandoned uploads may hold the space: free it (after a flush barrier)
            // and try once more.
            Err(Error::ResourcesExhausted(_)) if self.store.release_abandoned().await? > 0 => {
                self.store.allocate(blocks, hint)
            }
            r => r,
        }
        .map_err(|e| match e {
            Error::ResourcesExhausted(m) => {
                Error::ResourcesExhausted(format!("storing object {}: {m}", self.name))
            }
            other => other,
        })?;
        // Record ownership first, so abandonment returns them even if a write fails.
        for e in &got {
            match self.extents.last_mut() {
                Some(last) if last.end() == e.lba => last.blocks += e.blocks,
                _ => self.extents.push(*e),
            }
        }
        let dev = self.store.inner.dev.clone();
        if got.len() == 1 {
            let lba = got[0].lba;
            self.inflight.push(Box::pin(
                async move { dev.write(lba, buf).await.map(|_| ()) },
            ));
        } else {
            let mut off = 0usize;
            for e in got {
                let n = e.blocks as usize * bs;
                let mut part = DmaBuf::zeroed(n);
                part.copy_from_slice(&buf[off..off + n]);
                off += n;
                let dev = dev.clone();
                self.inflight.push(Box::pin(
                    async move { dev.write(e.lba, part).await.map(|_| ()) },
                ));
            }
        }
        while self.inflight.len() >= WRITES_IN_FLIGHT {
            if let Some(r) = self.inflight.next().await {
                r?;
            }
        }
        Ok(())
    }

    /// Writes the checksum table, waits for the data, and commits the object.
    pub async fn finish(mut self) -> Result<Arc<ObjectInfo>> {
        self.flush_staging().await?;
        let table: Vec<u8> = self.crcs.iter().flat_map(|c| c.to_le_bytes()).collect();
        let table_crc = crc32c::crc32c(&table);
        if !table.is_empty() {
            let bs = self.store.inner.sb.block_size as usize;
            let mut buf = DmaBuf::zeroed(table.len().div_ceil(bs) * bs);
            buf[..table.len()].copy_from_slice(&table);
            self.write_blocks(buf).await?;
        }
        while let Some(r) = self.inflight.next().await {
            r?;
        }
        let info = Arc::new(ObjectInfo {
            name: self.name.clone(),
            id: self.id,
            len: self.len,
            extents: self.extents.clone(),
            created_unix_ms: now_ms(),
            table_crc,
        });
        let name = self.name.clone();
        let to_commit = info.clone();
        self.store
            .commit_change(move |objects| Ok(objects.insert(name, to_commit).into_iter().collect()))
            .await?;
        self.done = true;
        Ok(info)
    }
}

impl Drop for ObjectWriter {
    fn drop(&mut self) {
        if !self.done && !self.extents.is_empty() {
            lock(&self.store.inner.quarantine).extend(self.extents.drain(..));
            // Whoever dropped it (a failed put, a handler dropped when its client
            // reset the stream), the space comes back now, not at the next put.
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                let store = self.store.clone();
                rt.spawn(async move {
                    if let Err(e) = store.release_abandoned().await {
                        tracing::warn!("returning an abandoned upload's space: {e}");
                    }
                });
            }
        }
    }
}
