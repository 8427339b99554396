//! A table (or partition) of this node as DataFusion sees it: its Parquet objects,
//! with footers and page indexes from the node's in-memory catalog and every read
//! going straight to the object store, counted.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
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

/// `schema` with its `Utf8` columns read as views, when it has any and no view
/// column of its own: the Parquet reader then hands out views into its pages
/// instead of copying every value, and DataFusion groups, compares and hashes views
/// of up to 12 bytes as one 128-bit word (a GROUP BY over a 100,000-value string
/// column spent most of its time in byte comparisons). Binary columns stay as
/// stored: DataFusion's Substrait consumer does not take `BinaryView` for a plan's
/// `Binary`. `None`: read as stored.
pub(super) fn with_views(schema: &SchemaRef) -> Option<SchemaRef> {
    let fields = schema.fields();
    let viewed = |t: &DataType| matches!(t, DataType::Utf8View | DataType::BinaryView);
    if fields.iter().any(|f| viewed(f.data_type()))
        || !fields.iter().any(|f| f.data_type() == &DataType::Utf8)
    {
        return None;
    }
    let fields: Vec<Field> = fields
        .iter()
        .map(|f| {
            let t = match f.data_type() {
                DataType::Utf8 => DataType::Utf8View,
                other => other.clone(),
            };
            f.as_ref().clone().with_data_type(t)
        })
        .collect();
    Some(Arc::new(Schema::new_with_metadata(
        fields,
        schema.metadata().clone(),
    )))
}

/// Whether `a` and `b` hold the same values in other layouts: plain and view
/// strings, plain and view binaries.
fn same_values(a: &DataType, b: &DataType) -> bool {
    use DataType::*;
    let strings = [Utf8, LargeUtf8, Utf8View];
    let binaries = [Binary, LargeBinary, BinaryView];
    (strings.contains(a) && strings.contains(b)) || (binaries.contains(a) && binaries.contains(b))
}

/// `stream` (of `schema`) in the types of `planned` where a column's type differs
/// only in layout (a view where the plan has a plain string); every other column
/// as it is. `None` when nothing needs casting or the column counts differ (the
/// asker then sees the difference and says so).
pub(super) fn as_planned(
    schema: &SchemaRef,
    planned: &SchemaRef,
) -> Option<(
    SchemaRef,
    impl Fn(RecordBatch) -> datafusion::common::Result<RecordBatch> + Send + 'static,
)> {
    if schema.fields().len() != planned.fields().len() {
        return None;
    }
    let casts: Vec<Option<DataType>> = schema
        .fields()
        .iter()
        .zip(planned.fields())
        .map(|(f, p)| {
            (f.data_type() != p.data_type() && same_values(f.data_type(), p.data_type()))
                .then(|| p.data_type().clone())
        })
        .collect();
    if casts.iter().all(Option::is_none) {
        return None;
    }
    let fields: Vec<Field> = schema
        .fields()
        .iter()
        .zip(&casts)
        .map(|(f, c)| match c {
            Some(t) => f.as_ref().clone().with_data_type(t.clone()),
            None => f.as_ref().clone(),
        })
        .collect();
    let out = Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()));
    let target = out.clone();
    let cast = move |b: RecordBatch| {
        let columns = b
            .columns()
            .iter()
            .zip(&casts)
            .map(|(c, t)| match t {
                Some(t) => arrow::compute::cast(c, t),
                None => Ok(c.clone()),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(RecordBatch::try_new_with_options(
            target.clone(),
            columns,
            &arrow::array::RecordBatchOptions::new().with_row_count(Some(b.num_rows())),
        )?)
    };
    Some((out, cast))
}

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
