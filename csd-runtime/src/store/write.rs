//! Changing the store: objects written ([`ObjectWriter`]: staged units, checksums,
//! writes in flight, a flush barrier, then the catalog commit that makes them
//! visible), replaced, deleted, and the space of abandoned ones reclaimed.

use super::*;

/// Objects are staged in memory and written in units of this many bytes.
pub(super) const WRITE_UNIT: usize = 1 << 20;
/// Writes in flight per object writer.
const WRITES_IN_FLIGHT: usize = 4;
impl ObjectStore {
    pub(super) fn check_writable(&self) -> Result<()> {
        if self.inner.failed.load(Ordering::Acquire) {
            return Err(Error::Unavailable(
                "an earlier flush or catalog write failed; the store is read-only until the node restarts"
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
        self.delete_where(prefix, |_| true).await
    }

    /// Deletes every object whose name starts with `prefix` and that `delete`
    /// says yes to, atomically.
    pub async fn delete_where(
        &self,
        prefix: &str,
        delete: impl Fn(&str) -> bool,
    ) -> Result<Vec<Arc<ObjectInfo>>> {
        let prefix = prefix.to_string();
        self.commit_change(|objects| {
            let names: Vec<String> = objects
                .keys()
                .filter(|k| k.starts_with(&prefix) && delete(k))
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
    pub(super) async fn commit_change(
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
        // device before the catalog that references it. A flush that fails is never
        // retried and believed: what it covered (this change's data, and any other
        // writer's since the last flush) may be gone, so no change commits until the
        // store is reopened and its catalog read again.
        if let Err(e) = inner.dev.flush().await {
            inner.failed.store(true, Ordering::Release);
            lock(&inner.quarantine).extend(quarantined);
            return Err(e);
        }
        // Another flush of this store (an abandoned upload's) that failed since this
        // change began may have lost this change's data, and this flush then had
        // nothing left to write: it succeeds, and must not be believed.
        if let Err(e) = self.check_writable() {
            lock(&inner.quarantine).extend(quarantined);
            return Err(e);
        }
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
            inner.dev.flush().await
        }
        .await;
        if let Err(e) = written {
            inner.failed.store(true, Ordering::Release);
            lock(&inner.quarantine).extend(quarantined);
            return Err(e);
        }
        // Durable from here: the slot just flushed holds the newest generation, so
        // the change is acknowledged even if the mirror fails (the store then stops
        // taking changes until a restart, which rewrites the mirror from it).
        let mirrored = async {
            inner.dev.write(inner.sb.slot_lba(1 - slot), mirror).await?;
            inner.dev.flush().await
        }
        .await;
        if let Err(e) = mirrored {
            tracing::error!(
                device = %inner.dev.geometry().name,
                "the catalog's mirror could not be written ({e}); the change is durable in \
                 the other slot, and the store takes no more changes until it restarts"
            );
            inner.failed.store(true, Ordering::Release);
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
        {
            let mut crc = lock(&inner.crc_tables);
            for d in &dropped {
                crc.remove(&d.id);
            }
        }
        lock(&inner.dropped).extend(dropped.iter().cloned());
        Ok(dropped)
    }

    /// On a device that deallocates (NVMe Dataset Management), tells it that the
    /// blocks of dropped objects nobody holds any more are free, then returns them to
    /// the free map; returns the bytes deallocated. Their catalog is durable already
    /// (they were dropped by a commit), and they leave the dropped list before the
    /// device hears of them, so a deallocation can neither lose a live object nor
    /// race a new write to the same blocks. Objects still held are left for later
    /// (this call again, or [`reclaim`](Self::reclaim) without deallocating).
    pub async fn deallocate_released(&self) -> u64 {
        let inner = &self.inner;
        if !inner.dev.can_deallocate() {
            return 0;
        }
        let released: Vec<Arc<ObjectInfo>> = {
            let mut d = lock(&inner.dropped);
            let (released, held) = std::mem::take(&mut *d)
                .into_iter()
                .partition(|o| Arc::strong_count(o) == 1);
            *d = held;
            released
        };
        let mut bytes = 0;
        for o in &released {
            for e in &o.extents {
                match inner.dev.deallocate(e.lba, e.blocks).await {
                    Ok(()) => bytes += e.blocks * inner.sb.block_size as u64,
                    // Advisory: the blocks are free in the catalog either way.
                    Err(err) => {
                        tracing::warn!(object = %o.name, error = %err, "deallocating freed blocks failed")
                    }
                }
            }
        }
        let mut a = lock(&inner.alloc);
        for o in released {
            o.extents.iter().for_each(|&e| a.free(e));
        }
        bytes
    }

    /// Frees the extents of dropped objects that no reader holds any more.
    pub(super) fn reclaim(&self, a: &mut Allocator) {
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
            // Never retried and believed (see commit_change).
            inner.failed.store(true, Ordering::Release);
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

    pub(super) fn allocate(&self, blocks: u64, hint: Option<u64>) -> Result<Vec<Extent>> {
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
