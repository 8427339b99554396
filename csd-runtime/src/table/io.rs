//! Parquet's async reader and writer over the object store: how the `parquet`
//! crate writes a stored object and reads one by byte range.

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions};
use parquet::arrow::async_reader::AsyncFileReader;
use parquet::arrow::async_writer::AsyncFileWriter;
use parquet::file::metadata::{PageIndexPolicy, ParquetMetaData, ParquetMetaDataReader};

use crate::error::{Error, Result, to_parquet};
use crate::store::{ObjectInfo, ObjectStore, ObjectWriter};

impl AsyncFileWriter for ObjectWriter {
    fn write(&mut self, bs: Bytes) -> BoxFuture<'_, parquet::errors::Result<()>> {
        async move { ObjectWriter::write(self, &bs).await.map_err(to_parquet) }.boxed()
    }

    fn complete(&mut self) -> BoxFuture<'_, parquet::errors::Result<()>> {
        // The object is committed by `ObjectWriter::finish`, after the footer.
        async { Ok(()) }.boxed()
    }
}

/// Reads one stored Parquet object by range (checksums verified by the store).
#[derive(Clone)]
pub struct ObjectReader {
    store: ObjectStore,
    object: Arc<ObjectInfo>,
    metadata: Option<Arc<ParquetMetaData>>,
    bytes_read: Option<Arc<std::sync::atomic::AtomicU64>>,
}

impl ObjectReader {
    /// A reader of `object`.
    pub fn new(store: ObjectStore, object: Arc<ObjectInfo>) -> Self {
        ObjectReader {
            store,
            object,
            metadata: None,
            bytes_read: None,
        }
    }

    /// Adds every byte read from the device to `counter` (per-request figures).
    pub fn with_counter(mut self, counter: Arc<std::sync::atomic::AtomicU64>) -> Self {
        self.bytes_read = Some(counter);
        self
    }

    fn count(&self, n: u64) {
        if let Some(c) = &self.bytes_read {
            c.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Reuses an already-loaded footer.
    pub fn with_metadata(mut self, m: Arc<ParquetMetaData>) -> Self {
        self.metadata = Some(m);
        self
    }

    /// Loads footer + page index + Arrow schema.
    pub(crate) async fn load_metadata(mut self) -> Result<ArrowReaderMetadata> {
        let opts = ArrowReaderOptions::new().with_page_index_policy(PageIndexPolicy::Optional);
        ArrowReaderMetadata::load_async(&mut self, opts)
            .await
            .map_err(|e| match Error::from(e) {
                e @ Error::External { .. } => Error::Corrupt(format!(
                    "object {} is not readable Parquet: {}",
                    self.object.name,
                    crate::error::chain(&e)
                )),
                other => other,
            })
    }
}

impl AsyncFileReader for ObjectReader {
    fn get_bytes(&mut self, range: Range<u64>) -> BoxFuture<'_, parquet::errors::Result<Bytes>> {
        async move {
            let len = range.end.saturating_sub(range.start);
            let b = self
                .store
                .read_object_range(&self.object, range.start, len)
                .await
                .map_err(to_parquet)?;
            self.count(b.len() as u64);
            Ok(b)
        }
        .boxed()
    }

    fn get_byte_ranges(
        &mut self,
        ranges: Vec<Range<u64>>,
    ) -> BoxFuture<'_, parquet::errors::Result<Vec<Bytes>>> {
        async move {
            let reads = ranges.into_iter().map(|r| {
                let len = r.end.saturating_sub(r.start);
                self.store.read_object_range(&self.object, r.start, len)
            });
            let out = futures::future::try_join_all(reads)
                .await
                .map_err(to_parquet)?;
            self.count(out.iter().map(|b| b.len() as u64).sum());
            Ok(out)
        }
        .boxed()
    }

    fn get_metadata<'a>(
        &'a mut self,
        _options: Option<&'a ArrowReaderOptions>,
    ) -> BoxFuture<'a, parquet::errors::Result<Arc<ParquetMetaData>>> {
        async move {
            if let Some(m) = &self.metadata {
                return Ok(m.clone());
            }
            // Always load the page index when present: scans prune pages with it.
            let policy = PageIndexPolicy::Optional;
            let len = self.object.len;
            let m = ParquetMetaDataReader::new()
                .with_page_index_policy(policy)
                .with_prefetch_hint(Some(64 * 1024))
                .load_and_finish(&mut *self, len)
                .await?;
            let m = Arc::new(m);
            self.metadata = Some(m.clone());
            Ok(m)
        }
        .boxed()
    }
}
