//! Parquet footers read by byte range keep their failure's kind.
//!
//! DataFusion's metadata fetch turns the cause of a failed footer read into text
//! ("Failed to fetch metadata for file …: …"), so a node's `DATA_LOSS` came out of a
//! query as an internal error (`csd` exiting 1, not 4, and no reader able to tell a
//! lost object from a bug). The readers made here put the kind back: when a footer
//! fetch fails, the kind of the range store's last failed read of that object
//! (a [`Failures`], the byte-range store) is attached to DataFusion's error as its
//! cause.

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::parquet::{
    CachedParquetFileReaderFactory, ParquetFileReaderFactory,
};
use datafusion::parquet::arrow::arrow_reader::ArrowReaderOptions;
use datafusion::parquet::arrow::async_reader::AsyncFileReader;
use datafusion::parquet::errors::ParquetError;
use datafusion::parquet::file::metadata::ParquetMetaData;
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use futures::FutureExt;
use futures::future::BoxFuture;
use object_store::path::Path;

use csd_protocol::StatusCode;

/// A store that remembers the kind of each object's last failed read.
pub(crate) trait Failures: std::fmt::Debug + Send + Sync {
    fn failure(&self, location: &Path) -> Option<StatusCode>;
}

/// DataFusion's caching reader factory, with footer failures typed again.
#[derive(Debug)]
pub(crate) struct TypedFooters {
    inner: CachedParquetFileReaderFactory,
    store: Arc<dyn Failures>,
}

impl TypedFooters {
    pub(crate) fn new(inner: CachedParquetFileReaderFactory, store: Arc<dyn Failures>) -> Self {
        TypedFooters { inner, store }
    }
}

impl ParquetFileReaderFactory for TypedFooters {
    fn create_reader(
        &self,
        partition_index: usize,
        partitioned_file: PartitionedFile,
        metadata_size_hint: Option<usize>,
        metrics: &ExecutionPlanMetricsSet,
    ) -> datafusion::common::Result<Box<dyn AsyncFileReader + Send>> {
        let location = partitioned_file.object_meta.location.clone();
        let inner = self.inner.create_reader(
            partition_index,
            partitioned_file,
            metadata_size_hint,
            metrics,
        )?;
        Ok(Box::new(TypedFooterReader {
            inner,
            location,
            store: self.store.clone(),
        }))
    }
}

struct TypedFooterReader {
    inner: Box<dyn AsyncFileReader + Send>,
    location: Path,
    store: Arc<dyn Failures>,
}

impl AsyncFileReader for TypedFooterReader {
    fn get_bytes(&mut self, range: Range<u64>) -> BoxFuture<'_, Result<Bytes, ParquetError>> {
        self.inner.get_bytes(range)
    }

    fn get_byte_ranges(
        &mut self,
        ranges: Vec<Range<u64>>,
    ) -> BoxFuture<'_, Result<Vec<Bytes>, ParquetError>> {
        self.inner.get_byte_ranges(ranges)
    }

    fn get_metadata<'a>(
        &'a mut self,
        options: Option<&'a ArrowReaderOptions>,
    ) -> BoxFuture<'a, Result<Arc<ParquetMetaData>, ParquetError>> {
        async move {
            let flattened = match self.inner.get_metadata(options).await {
                Ok(m) => return Ok(m),
                Err(e) => e,
            };
            Err(match self.store.failure(&self.location) {
                Some(code) => ParquetError::External(Box::new(csd_protocol::Error::external(
                    code,
                    format!("reading the footer of {}", self.location),
                    flattened,
                ))),
                None => flattened,
            })
        }
        .boxed()
    }
}
