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
mod read;
mod scrub;
mod write;

use read::ReadCache;
pub use scrub::{Pace, Turn, Unpaced};
pub use write::ObjectWriter;
use write::WRITE_UNIT;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use prost::Message;
use serde::{Deserialize, Serialize};

use crate::device::{BlockDevice, DmaBuf};
use crate::error::{Error, Result};
use alloc::Allocator;
pub use alloc::Extent;
pub use csd_protocol::stats::{ReadCacheStats, ScrubReport, StoreStats};
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
    /// A digest of the object's bytes: the CRC-32C of its chunks' CRC table, equal
    /// for equal bytes wherever they are stored.
    pub fn digest(&self) -> u32 {
        self.table_crc
    }

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
    /// Reads refused as damaged since open.
    corrupt_reads: std::sync::atomic::AtomicU64,
    /// What scrubs since open found.
    scrubs: Mutex<ScrubReport>,
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
                corrupt_reads: std::sync::atomic::AtomicU64::new(0),
                scrubs: Mutex::new(Default::default()),
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
        // A slot the medium cannot read is as good as a torn one: the other is used,
        // and this one rewritten from it.
        let unreadable = |e: Error| match e {
            Error::Io { .. } | Error::Corrupt(_) => {
                tracing::warn!(device = %dev.geometry().name, "catalog slot {slot} cannot be read: {e}");
                Ok(None)
            }
            e => Err(e),
        };
        let head = match dev.read(sb.slot_lba(slot), DmaBuf::zeroed(bs)).await {
            Ok(h) => h,
            Err(e) => return unreadable(e),
        };
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
            match dev
                .read(sb.slot_lba(slot), DmaBuf::zeroed(blocks * bs))
                .await
            {
                Ok(b) => b,
                Err(e) => return unreadable(e),
            }
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
            corrupt_reads: self.inner.corrupt_reads.load(Ordering::Relaxed),
            scrub: lock(&self.inner.scrubs).clone(),
        }
    }
}
