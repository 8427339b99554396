//! One way to scan a set of Parquet objects with DataFusion, used on both sides: by the
//! storage node over its own objects, and by the no-pushdown baseline over the node's
//! byte ranges. Same options on both sides, so comparisons are fair: row-group
//! statistics and page-index pruning; filters run on decoded batches (see
//! [`configure`] for why not while decoding), unless the fragment asks for late
//! filters (`SqlFragment::late_filters`: a filter keeping very few rows of a wide
//! read).

use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use datafusion::catalog::Session;
use datafusion::common::stats::Precision;
use datafusion::common::{DFSchema, Result, Statistics};
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::parquet::ParquetFileReaderFactory;
use datafusion::datasource::physical_plan::{FileGroup, FileScanConfigBuilder, ParquetSource};
use datafusion::datasource::source::DataSourceExec;
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::projection::ProjectionExec;

/// The session options both sides scan with.
pub(crate) fn configure(
    config: datafusion::prelude::SessionConfig,
) -> datafusion::prelude::SessionConfig {
    let mut config = config;
    let o = config.options_mut();
    // Late materialization (filters evaluated while decoding) stays off, as in
    // DataFusion's defaults: on TPC-H's unsorted columns the filters leave scattered
    // row selections whose bookkeeping costs more than the decoding it saves, on
    // both sides of the comparison.
    o.execution.parquet.pushdown_filters = false;
    o.execution.parquet.enable_page_index = true;
    o.execution.parquet.pruning = true;
    config
}

/// All filters are applied exactly by [`parquet_scan`].
pub(crate) fn exact(filters: &[&Expr]) -> Vec<TableProviderFilterPushDown> {
    vec![TableProviderFilterPushDown::Exact; filters.len()]
}

/// Scans `files` (name, length, rows) of a table with `schema` under `url`: reads the
/// columns of `projection` and `filters`, applies `filters` exactly (DataFusion
/// uses them to prune row groups and pages, then filters the decoded rows), and
/// returns `projection`. `limit` applies when there are no filters (callers keep
/// their own limit above).
#[allow(clippy::too_many_arguments)]
pub(crate) fn parquet_scan(
    state: &dyn Session,
    url: &ObjectStoreUrl,
    schema: &SchemaRef,
    files: Vec<(String, u64, u64)>,
    projection: Option<&Vec<usize>>,
    filters: &[Expr],
    limit: Option<usize>,
    reader: Option<Arc<dyn ParquetFileReaderFactory>>,
) -> Result<Arc<dyn ExecutionPlan>> {
    let mut source = ParquetSource::new(schema.clone())
        .with_table_parquet_options(state.table_options().parquet.clone());
    if let Some(r) = reader {
        source = source.with_parquet_file_reader_factory(r);
    }
    let group: FileGroup = files
        .into_iter()
        .map(|(name, len, rows)| {
            // Row counts (from the footers, as DataFusion's listing tables collect
            // them) let the optimizer order joins.
            let stats =
                Statistics::new_unknown(schema).with_num_rows(Precision::Exact(rows as usize));
            PartitionedFile::new(name, len).with_statistics(Arc::new(stats))
        })
        .collect::<Vec<_>>()
        .into();
    // Columns read: the projection plus whatever the filters need.
    let all: Vec<usize> = (0..schema.fields().len()).collect();
    let wanted = projection.cloned().unwrap_or_else(|| all.clone());
    let predicate = balanced_conjunction(filters.to_vec());
    let mut read = wanted.clone();
    if let Some(p) = &predicate {
        for c in p.column_refs() {
            let i = schema.index_of(&c.name)?;
            if !read.contains(&i) {
                read.push(i);
            }
        }
    }
    let builder = FileScanConfigBuilder::new(url.clone(), Arc::new(source))
        .with_file_groups(vec![group])
        .with_limit(if predicate.is_none() { limit } else { None })
        .with_projection_indices(Some(read.clone()))?;
    let mut plan: Arc<dyn ExecutionPlan> = DataSourceExec::from_data_source(builder.build());
    if let Some(p) = predicate {
        let read_schema = Arc::new(schema.project(&read)?);
        let df_schema = DFSchema::try_from(read_schema.as_ref().clone())?;
        let physical = state.create_physical_expr(p, &df_schema)?;
        plan = Arc::new(FilterExec::try_new(physical, plan)?);
        if read.len() != wanted.len() {
            let exprs = (0..wanted.len())
                .map(|i| {
                    let f = read_schema.field(i);
                    (
                        Arc::new(datafusion::physical_expr::expressions::Column::new(
                            f.name(),
                            i,
                        )) as _,
                        f.name().clone(),
                    )
                })
                .collect::<Vec<_>>();
            plan = Arc::new(ProjectionExec::try_new(exprs, plan)?);
        }
    }
    Ok(plan)
}

/// `parts` ANDed as a balanced tree. DataFusion's Substrait producer formats each
/// binary expression's whole subtree to name it, and a physical binary expression
/// asks its whole subtree for its type, so a left-deep chain of n conditions costs
/// n² (1,000 conditions: over a minute); balanced, n log n.
pub(crate) fn balanced_conjunction(mut parts: Vec<Expr>) -> Option<Expr> {
    while parts.len() > 1 {
        let mut next = Vec::with_capacity(parts.len().div_ceil(2));
        let mut it = parts.into_iter();
        while let Some(a) = it.next() {
            next.push(match it.next() {
                Some(b) => a.and(b),
                None => a,
            });
        }
        parts = next;
    }
    parts.pop()
}
