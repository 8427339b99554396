//! A table (or partition) of this node as DataFusion sees it: its Parquet objects,
//! with footers and page indexes from the node's in-memory catalog and every read
//! going straight to the object store, counted.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use csd_runtime::store::ObjectStore as NodeObjects;
use csd_runtime::table::{ObjectReader, ParquetObject};
use datafusion::catalog::Session;
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::parquet::ParquetFileReaderFactory;
use datafusion::datasource::{TableProvider, TableType};
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown};
use datafusion::parquet::arrow::async_reader::AsyncFileReader;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;

use crate::eval::scan;

/// Object-store URL the node's scans use (reads go through [`NodeReaderFactory`]).
pub(super) const NODE_URL: &str = "csd-node://local";

/// One table (or partition) of this node, as DataFusion sees it.
#[derive(Debug)]
pub(super) struct NodeTable {
    pub(super) schema: SchemaRef,
    pub(super) objects: HashMap<String, ParquetObject>,
    pub(super) store: NodeObjects,
    pub(super) bytes_read: Arc<AtomicU64>,
}

#[async_trait]
impl TableProvider for NodeTable {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }
    fn table_type(&self) -> TableType {
        TableType::Base
    }
    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> datafusion::common::Result<Vec<TableProviderFilterPushDown>> {
        Ok(scan::exact(filters))
    }
    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> datafusion::common::Result<Arc<dyn ExecutionPlan>> {
        let mut files: Vec<(String, u64, u64)> = self
            .objects
            .values()
            .map(|o| (o.object.name.clone(), o.object.len, o.rows()))
            .collect();
        files.sort();
        let reader = Arc::new(NodeReaderFactory {
            objects: self.objects.clone(),
            store: self.store.clone(),
            bytes_read: self.bytes_read.clone(),
        });
        scan::parquet_scan(
            state,
            &ObjectStoreUrl::parse(NODE_URL)?,
            &self.schema,
            files,
            projection,
            filters,
            limit,
            Some(reader),
        )
    }
}

/// Hands DataFusion readers over the node's objects, with footers from the catalog.
#[derive(Debug)]
struct NodeReaderFactory {
    objects: HashMap<String, ParquetObject>,
    store: NodeObjects,
    bytes_read: Arc<AtomicU64>,
}

impl ParquetFileReaderFactory for NodeReaderFactory {
    fn create_reader(
        &self,
        _partition_index: usize,
        file: PartitionedFile,
        _metadata_size_hint: Option<usize>,
        _metrics: &ExecutionPlanMetricsSet,
    ) -> datafusion::common::Result<Box<dyn AsyncFileReader + Send>> {
        let name = file.object_meta.location.as_ref();
        let o = self.objects.get(name).ok_or_else(|| {
            datafusion::common::DataFusionError::Internal(format!("object {name} vanished"))
        })?;
        Ok(Box::new(
            ObjectReader::new(self.store.clone(), o.object.clone())
                .with_metadata(o.metadata.metadata().clone())
                .with_counter(self.bytes_read.clone()),
        ))
    }
}
