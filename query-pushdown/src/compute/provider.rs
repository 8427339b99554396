//! Compute side: a table held by storage nodes, as a DataFusion `TableProvider`.
//!
//! Discovered from the nodes (`ListFlights`); every (node, partition) pair is one
//! endpoint and one partition of the scan, read in parallel. Projection, the filters
//! a node can evaluate exactly, and LIMIT travel to the nodes as a Substrait
//! fragment; the optimizer rule in [`crate::compute::pushdown`] adds partial aggregates and top-k.

use std::sync::{Arc, OnceLock};

use arrow::datatypes::{DataType, SchemaRef};
use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::common::stats::Precision;
use datafusion::common::{
    ColumnStatistics, DFSchema, DataFusionError, Result, ScalarValue, TableReference,
};
use datafusion::datasource::{TableProvider, TableType, provider_as_source, source_as_provider};
use datafusion::execution::SessionState;
use datafusion::execution::SessionStateBuilder;
use datafusion::logical_expr::utils::{conjunction, split_conjunction, split_conjunction_owned};
use datafusion::logical_expr::{
    Expr, LogicalPlan, LogicalPlanBuilder, TableProviderFilterPushDown, TableScan,
};
use datafusion::physical_expr::intervals::utils::check_support;
use datafusion::physical_expr::{AnalysisContext, analyze};
use datafusion::physical_plan::ExecutionPlan;
use datafusion_substrait::logical_plan::producer::to_substrait_plan;
use datafusion_substrait::substrait::proto::Plan;
use prost::Message;

use crate::compute::endpoints::{Endpoint, TableEndpoints};
use crate::compute::pushable::pushable;
use crate::compute::sandbox::functions_in;
use crate::compute::scan::CsdScanExec;
use crate::eval::scan::balanced_conjunction;
use crate::options::CsdOptions;
use crate::wire::connectives::flatten_connectives;
use crate::wire::fragment::Mode;
use crate::wire::fragment::{MAX_PLAN_BYTES, validate};
use crate::wire::functions::node_evaluates;
use crate::wire::shipped::ShippedFunction;

/// A table spread over storage nodes, with pushdown.
#[derive(Debug, Clone)]
pub struct CsdTable {
    inner: Arc<TableEndpoints>,
}

impl CsdTable {
    /// The table `at` its endpoints. With `csd.direct_unfiltered` (the default),
    /// scans that would not reduce anything (no filter, no limit) read the Parquet
    /// objects by range: compressed column chunks are smaller than the same columns
    /// as Arrow IPC, and the node's CPU is spared.
    pub fn new(at: TableEndpoints) -> Self {
        CsdTable {
            inner: Arc::new(at),
        }
    }

    /// The storage-node table `scan` reads, if it reads one.
    pub(crate) fn of_scan(scan: &TableScan) -> Option<CsdTable> {
        let provider = source_as_provider(&scan.source).ok()?;
        provider.downcast_ref::<CsdTable>().cloned()
    }

    /// Where the table lives and how its fragments travel.
    pub fn at(&self) -> &Arc<TableEndpoints> {
        &self.inner
    }

    /// Table name.
    pub fn name(&self) -> &str {
        self.inner.name()
    }

    /// Encodes `fragment` (a plan over this table) as Substrait, with the table named
    /// bare as the node knows it and `AND`/`OR` chains flattened; `Ok(Err(why))` when
    /// a node would not take it (see `sendable`).
    pub fn substrait(
        &self,
        fragment: &LogicalPlan,
        state: &SessionState,
    ) -> Result<std::result::Result<Encoded, Unsendable>> {
        use datafusion::common::tree_node::{Transformed, TreeNode};
        let bare = fragment
            .clone()
            .transform_up(|p| match p {
                LogicalPlan::TableScan(mut s) => {
                    s.table_name = TableReference::bare(self.name());
                    s.filters = balanced_conjunction(std::mem::take(&mut s.filters))
                        .into_iter()
                        .collect();
                    Ok(Transformed::yes(LogicalPlan::TableScan(s)))
                }
                LogicalPlan::Filter(mut f) => {
                    let parts = split_conjunction_owned(f.predicate.clone());
                    if let Some(p) = balanced_conjunction(parts) {
                        f.predicate = p;
                    }
                    Ok(Transformed::yes(LogicalPlan::Filter(f)))
                }
                other => Ok(Transformed::no(other)),
            })?
            .data;
        let functions = functions_in(&bare);
        let mut plan = to_substrait_plan(&bare, state)?;
        flatten_connectives(&mut plan);
        Ok(
            sendable(&plan, self.name(), MAX_PLAN_BYTES, &functions).map(|()| Encoded {
                plan: plan.encode_to_vec(),
                functions,
            }),
        )
    }

    /// Rows in all its partitions.
    pub fn rows(&self) -> u64 {
        self.inner.rows()
    }

    /// Whether every row with a given value of `column` lives in one endpoint: the
    /// endpoints' `[min, max]` ranges of it (from exact footer statistics of
    /// NULL-free integer/date columns) do not overlap. Then an aggregate grouped by
    /// it is complete at each partition. False when any non-empty endpoint's range
    /// is unknown.
    pub(crate) fn disjoint_on(&self, column: &str) -> bool {
        let Ok(i) = self.inner.schema().index_of(column) else {
            return false;
        };
        let mut ranges = Vec::new();
        for e in self.inner.endpoints() {
            match range_in(std::slice::from_ref(e), i) {
                Ok(r) => ranges.extend(r),
                Err(()) => return false,
            }
        }
        ranges.sort_unstable();
        ranges.windows(2).all(|w| w[0][1] < w[1][0])
    }

    /// The fraction of rows `filters` are expected to keep, for the optimizer's join
    /// order. The conjuncts over integer and date columns with known `[min, max]` (from
    /// the footers) are estimated together by DataFusion's interval analysis, as its
    /// `FilterExec` does with column statistics; any other conjunct counts as 20%,
    /// DataFusion's default selectivity. Q10's quarter of `o_orderdate` then reads
    /// 57,000 orders, not 300,000, and `orders`, not all of `customer`, builds the join.
    fn estimate(&self, session: &dyn Session, filters: &[Expr]) -> f64 {
        const DEFAULT: f64 = 0.2;
        if filters.is_empty() {
            return 1.0;
        }
        let schema = self.inner.schema();
        let ranges: Vec<Option<[i64; 2]>> = (0..schema.fields().len())
            .map(|i| range_in(self.inner.endpoints(), i).ok().flatten())
            .collect();
        let known = |e: &Expr| {
            e.column_refs()
                .iter()
                .all(|c| schema.index_of(c.name()).is_ok_and(|i| ranges[i].is_some()))
        };
        let conjuncts: Vec<Expr> = filters
            .iter()
            .flat_map(|f| split_conjunction(f).into_iter().cloned())
            .collect();
        let (analysable, rest): (Vec<Expr>, Vec<Expr>) =
            conjuncts.into_iter().partition(|e| known(e));
        let other = if rest.is_empty() { 1.0 } else { DEFAULT };
        let Some(predicate) = conjunction(analysable) else {
            return other;
        };
        let analysed = (|| -> Result<Option<f64>> {
            let df_schema = DFSchema::try_from(schema.as_ref().clone())?;
            let expr = session.create_physical_expr(predicate, &df_schema)?;
            if !check_support(&expr, schema) {
                return Ok(None);
            }
            let stats: Vec<ColumnStatistics> = schema
                .fields()
                .iter()
                .zip(&ranges)
                .map(|(f, r)| {
                    let c = ColumnStatistics::new_unknown();
                    match r.and_then(|[lo, hi]| {
                        Some((scalar(f.data_type(), lo)?, scalar(f.data_type(), hi)?))
                    }) {
                        Some((lo, hi)) => c
                            .with_min_value(Precision::Exact(lo))
                            .with_max_value(Precision::Exact(hi))
                            .with_null_count(Precision::Exact(0)),
                        None => c,
                    }
                })
                .collect();
            let context = AnalysisContext::try_from_statistics(schema, &stats)?;
            Ok(analyze(&expr, context, schema)?.selectivity)
        })();
        match analysed {
            Ok(Some(f)) if f.is_finite() => f.clamp(0.0, 1.0) * other,
            _ => DEFAULT,
        }
    }

    /// Whether `e` can be evaluated exactly at the node and travels as Substrait.
    pub(crate) fn can_push(&self, e: &Expr) -> bool {
        if !pushable(e) {
            return false;
        }
        // Make sure it encodes as a filter over a scan of this table, within the
        // node's limits and a quarter of its plan budget (so that several such
        // filters still fit one fragment).
        static STATE: OnceLock<SessionState> = OnceLock::new();
        let state =
            STATE.get_or_init(|| SessionStateBuilder::new().with_default_features().build());
        let plan = LogicalPlanBuilder::scan(
            self.name(),
            provider_as_source(Arc::new(self.clone())),
            None,
        )
        .and_then(|b| b.filter(e.clone()))
        .and_then(|b| b.build())
        .and_then(|p| Ok((functions_in(&p), to_substrait_plan(&p, state)?)));
        match plan {
            Ok((functions, mut p)) => {
                flatten_connectives(&mut p);
                sendable(&p, self.name(), MAX_PLAN_BYTES / 4, &functions).is_ok()
            }
            Err(_) => false,
        }
    }
}

/// Why a node would not take a fragment: the compute tier then runs it itself.
#[derive(Debug)]
pub enum Unsendable {
    /// Its Substrait plan is larger than what is sent to a node.
    TooLarge {
        /// The plan's bytes.
        bytes: usize,
        /// The most sent.
        max: usize,
    },
    /// A node's own check of a fragment refuses it (`wire::fragment::validate`: its
    /// shape, its limits, a function nodes do not evaluate).
    Refused(csd_protocol::Error),
}

impl std::fmt::Display for Unsendable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unsendable::TooLarge { bytes, max } => write!(
                f,
                "its Substrait plan is {bytes} bytes, over the {max} bytes sent to a node"
            ),
            Unsendable::Refused(e) => write!(f, "{e}"),
        }
    }
}

/// Whether a node would take `plan` (a fragment over `table`): within `max_bytes`
/// and the node's limits, calling only functions nodes evaluate. Else why not.
fn sendable(
    plan: &Plan,
    table: &str,
    max_bytes: usize,
    functions: &[Arc<ShippedFunction>],
) -> std::result::Result<(), Unsendable> {
    let bytes = plan.encoded_len();
    if bytes > max_bytes {
        return Err(Unsendable::TooLarge {
            bytes,
            max: max_bytes,
        });
    }
    validate(plan, table, &|f| {
        node_evaluates(f) || functions.iter().any(|s| s.name == f)
    })
    .map_err(Unsendable::Refused)
}

/// A fragment encoded for a node: its Substrait plan and the Wasm SQL functions it
/// calls.
#[derive(Debug, Clone)]
pub struct Encoded {
    /// The Substrait plan, protobuf-encoded.
    pub plan: Vec<u8>,
    /// The Wasm SQL functions the plan calls (their modules travel with it).
    pub functions: Vec<Arc<ShippedFunction>>,
}

/// `session` as the full state the Substrait producer needs.
pub(crate) fn session_state(session: &dyn Session) -> Result<&SessionState> {
    session
        .as_any()
        .downcast_ref::<SessionState>()
        .ok_or_else(|| {
            DataFusionError::Internal("csd tables need a DataFusion SessionState".into())
        })
}

#[async_trait]
impl TableProvider for CsdTable {
    fn schema(&self) -> SchemaRef {
        self.inner.schema().clone()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> Result<Vec<TableProviderFilterPushDown>> {
        Ok(filters
            .iter()
            .map(|f| {
                if self.can_push(f) {
                    TableProviderFilterPushDown::Exact
                } else {
                    TableProviderFilterPushDown::Unsupported
                }
            })
            .collect())
    }

    async fn scan(
        &self,
        session: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let state = session_state(session)?;
        let mut b = LogicalPlanBuilder::scan_with_filters(
            TableReference::bare(self.name()),
            provider_as_source(Arc::new(self.clone())),
            projection.cloned(),
            filters.to_vec(),
        )?;
        if limit.is_some() {
            b = b.limit(0, limit)?;
        }
        let fragment = b.build()?;
        let schema = Arc::new(fragment.schema().as_arrow().clone());
        let encoded = match self.substrait(&fragment, state)? {
            Ok(e) => e,
            // Legal, but past what a node takes (an IN list of 20,000 items, a plan
            // over 1 MiB): the compute tier reads the table by byte range and
            // evaluates it all itself.
            Err(why) => {
                tracing::debug!(table = self.name(), "not pushed: {why}");
                let local = self.inner.range_table(self.inner.endpoints());
                return local.scan(session, projection, filters, limit).await;
            }
        };
        let fraction = self.estimate(session, filters);
        let columns = match projection {
            Some(p) => p.clone(),
            None => (0..self.inner.schema().fields().len()).collect(),
        };
        let options = CsdOptions::of(session.config_options());
        let late = fraction <= options.late_filters_below
            && wide_beside(self.inner.schema(), &columns, filters);
        let scan = CsdScanExec::new(
            self.inner.clone(),
            schema,
            encoded.plan,
            Mode::Complete,
            describe(&fragment),
        )
        .with_functions(encoded.functions)
        .with_estimate(Some(fraction), limit)
        .with_table_columns(columns);
        let scan = if late { scan.late_filters() } else { scan };
        let reduces_nothing = filters.is_empty() && limit.is_none();
        Ok(Arc::new(if reduces_nothing && options.direct_unfiltered {
            scan.direct()
        } else {
            scan
        }))
    }
}

/// Whether a scan of `columns` of `schema` filtered by `filters` reads at least two
/// other columns, and twice as many as the filters' own: only then does decoding the
/// filters' columns first save more than the row selection costs (benches/RESULTS.md
/// has the measurements).
fn wide_beside(schema: &SchemaRef, columns: &[usize], filters: &[Expr]) -> bool {
    let mut filtered: Vec<usize> = Vec::new();
    for f in filters {
        for c in f.column_refs() {
            match schema.index_of(c.name()) {
                Ok(i) if !filtered.contains(&i) => filtered.push(i),
                Ok(_) => {}
                Err(_) => return false,
            }
        }
    }
    let others = columns.iter().filter(|c| !filtered.contains(c)).count();
    !filtered.is_empty() && others >= 2 && others >= 2 * filtered.len()
}

/// `[min, max]` of column `i` over the non-empty objects of `endpoints`: `Ok(None)`
/// when they hold no rows, `Err` when some object's range is unknown.
fn range_in(endpoints: &[Endpoint], i: usize) -> std::result::Result<Option<[i64; 2]>, ()> {
    let mut range: Option<[i64; 2]> = None;
    for o in endpoints
        .iter()
        .flat_map(|e| &e.objects)
        .filter(|o| o.rows > 0)
    {
        let Some(Some([lo, hi])) = o.int_ranges.get(i) else {
            return Err(());
        };
        range = Some(match range {
            None => [*lo, *hi],
            Some([a, b]) => [a.min(*lo), b.max(*hi)],
        });
    }
    Ok(range)
}

/// `v` as a value of an integer or date column of type `t`.
fn scalar(t: &DataType, v: i64) -> Option<ScalarValue> {
    Some(match t {
        DataType::Int8 => ScalarValue::Int8(Some(i8::try_from(v).ok()?)),
        DataType::Int16 => ScalarValue::Int16(Some(i16::try_from(v).ok()?)),
        DataType::Int32 => ScalarValue::Int32(Some(i32::try_from(v).ok()?)),
        DataType::Int64 => ScalarValue::Int64(Some(v)),
        DataType::Date32 => ScalarValue::Date32(Some(i32::try_from(v).ok()?)),
        _ => return None,
    })
}

/// A fragment on one line, for EXPLAIN: `Limit: … ← TableScan: …`.
pub(crate) fn describe(fragment: &LogicalPlan) -> String {
    fragment
        .display_indent()
        .to_string()
        .lines()
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" ← ")
}
