//! Several small-range integer group keys packed into one.
//!
//! DataFusion groups by one primitive column with a hash table of that primitive
//! (`GroupValuesPrimitive`), and by several columns with a column-wise table that
//! hashes, stores and compares each column apart (`GroupValuesColumn`). A partial
//! aggregate at a node over ten million rows grouped by two integer keys spent most
//! of its time in the second. But a node knows each integer column's exact range
//! from its objects' footers, and keys of a few thousand values each fit together in
//! one `u64`: key `i` of range `[lo, hi]` becomes the digit `v - lo + 1` (0 for NULL)
//! of radix `hi - lo + 2`, and the digits one number. [`packed`] rewrites each
//! partial aggregate whose keys all fit so: it groups by [`PackKeysExpr`] and a
//! projection above it ([`UnpackKeyExpr`]) gives back the original key columns, so
//! the plan above sees the same schema and the same partial states.
//!
//! A key may be a column or a cast of one to a type that holds every value of the
//! range apart (a wider integer, or a float with an exact significand); the digit is
//! the column's value and the cast is applied when unpacking. A value outside the
//! range its footers gave fails the query (never a wrong group).

use std::collections::HashMap;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, Int64Array, RecordBatch, UInt64Array};
use arrow::datatypes::{DataType, FieldRef, Int64Type, Schema, UInt64Type};
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{DataFusionError, Result};
use datafusion::logical_expr::ColumnarValue;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::{CastExpr, Column, TryCastExpr};
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode, PhysicalGroupBy};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::limit::{GlobalLimitExec, LocalLimitExec};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::{ExecutionPlan, InputOrderMode};

use crate::eval::keyfilter::KeyFilterExec;

/// The packed key's column name in the rewritten aggregate's output.
const PACKED: &str = "__csd_packed_keys";

/// Exact `[min, max]` of a table's integer columns (by name) over the objects a
/// fragment reads, from their footers; a column left out has no known range.
pub(crate) type KeyRanges = HashMap<String, [i64; 2]>;

/// `plan` with every partial aggregate whose keys all fit packed (see the module),
/// and how many were.
pub(crate) fn packed(
    plan: Arc<dyn ExecutionPlan>,
    ranges: &KeyRanges,
) -> Result<(Arc<dyn ExecutionPlan>, usize)> {
    if ranges.is_empty() {
        return Ok((plan, 0));
    }
    let mut count = 0;
    let plan = plan
        .transform_up(|p| {
            let Some(a) = p.downcast_ref::<AggregateExec>() else {
                return Ok(Transformed::no(p));
            };
            Ok(match pack(a, ranges)? {
                Some(rewritten) => {
                    count += 1;
                    Transformed::yes(rewritten)
                }
                None => Transformed::no(p),
            })
        })?
        .data;
    Ok((plan, count))
}

/// One key's place in the packed number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Digit {
    /// The smallest value of the key's column.
    lo: i64,
    /// `hi - lo + 1`: the largest digit (digits run from 0, NULL, to `span`).
    span: u64,
    /// What the digit is multiplied by.
    weight: u64,
}

impl Digit {
    fn radix(&self) -> u64 {
        self.span + 1
    }
}

/// `a` rewritten over packed keys, when it is a partial aggregate whose keys all fit.
fn pack(a: &AggregateExec, ranges: &KeyRanges) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let group = a.group_expr();
    if *a.mode() != AggregateMode::Partial
        || !group.is_single()
        || group.expr().len() < 2
        || a.limit_options().is_some()
        || *a.input_order_mode() != InputOrderMode::Linear
    {
        return Ok(None);
    }
    let input = a.input();
    let input_schema = input.schema();
    // Each key: the input column it reads, and that column's range.
    let mut keys = Vec::with_capacity(group.expr().len());
    for (e, _) in group.expr() {
        let Some(column) = raw_column(e, &input_schema) else {
            return Ok(None);
        };
        let Some(range) =
            source_name(input, column.index()).and_then(|name| ranges.get(&name).copied())
        else {
            return Ok(None);
        };
        if !holds_apart(e, range) {
            return Ok(None);
        }
        keys.push((column, range));
    }
    // Mixed radix, last key least significant; the whole must fit a u64.
    let mut digits = vec![
        Digit {
            lo: 0,
            span: 0,
            weight: 0
        };
        keys.len()
    ];
    let mut weight = 1u64;
    for (d, (_, [lo, hi])) in digits.iter_mut().zip(&keys).rev() {
        let Some(span) = hi
            .checked_sub(*lo)
            .and_then(|s| u64::try_from(s).ok())
            .and_then(|s| s.checked_add(1))
        else {
            return Ok(None);
        };
        *d = Digit {
            lo: *lo,
            span,
            weight,
        };
        let Some(next) = weight.checked_mul(span + 1) else {
            return Ok(None);
        };
        weight = next;
    }
    let pack: Arc<dyn PhysicalExpr> = Arc::new(PackKeysExpr {
        keys: keys
            .iter()
            .zip(&digits)
            .map(|((c, _), d)| (Arc::new(c.clone()) as Arc<dyn PhysicalExpr>, *d))
            .collect(),
    });
    let inner = AggregateExec::try_new(
        AggregateMode::Partial,
        PhysicalGroupBy::new_single(vec![(pack, PACKED.to_string())]),
        a.aggr_expr().to_vec(),
        a.filter_expr().to_vec(),
        input.clone(),
        a.input_schema(),
    )?;
    let inner: Arc<dyn ExecutionPlan> = Arc::new(inner);
    let original = a.schema();
    let packed_column: Arc<dyn PhysicalExpr> = Arc::new(Column::new(PACKED, 0));
    let mut exprs: Vec<(Arc<dyn PhysicalExpr>, String)> =
        Vec::with_capacity(original.fields().len());
    for (i, (((e, name), (column, _)), d)) in
        group.expr().iter().zip(&keys).zip(&digits).enumerate()
    {
        let raw_field = input_schema.field(column.index());
        let raw = Arc::new(Schema::new(vec![raw_field.clone()]));
        let over_raw = e.clone().transform(|x| {
            Ok(match x.downcast_ref::<Column>() {
                Some(c) if c.index() == column.index() => {
                    Transformed::yes(Arc::new(Column::new(c.name(), 0)) as Arc<dyn PhysicalExpr>)
                }
                _ => Transformed::no(x),
            })
        })?;
        let field = original.field(i);
        exprs.push((
            Arc::new(UnpackKeyExpr {
                packed: packed_column.clone(),
                digit: *d,
                raw,
                expr: over_raw.data,
                field: Arc::new(field.clone()),
            }),
            name.clone(),
        ));
    }
    let inner_schema = inner.schema();
    for (i, f) in inner_schema.fields().iter().enumerate().skip(1) {
        exprs.push((Arc::new(Column::new(f.name(), i)), f.name().clone()));
    }
    let projection = ProjectionExec::try_new(exprs, inner)?;
    // The plan above reads the original's columns by position: nothing changes for
    // it, or nothing is rewritten.
    if projection.schema() != original {
        return Ok(None);
    }
    Ok(Some(Arc::new(projection)))
}

/// The input column `e` reads, when `e` is a column or casts of one.
fn raw_column(e: &Arc<dyn PhysicalExpr>, schema: &Schema) -> Option<Column> {
    if let Some(c) = e.downcast_ref::<Column>() {
        let t = schema.fields().get(c.index())?.data_type();
        return integer(t).then(|| c.clone());
    }
    if let Some(c) = e.downcast_ref::<CastExpr>() {
        return raw_column(c.expr(), schema);
    }
    if let Some(c) = e.downcast_ref::<TryCastExpr>() {
        return raw_column(c.expr(), schema);
    }
    None
}

/// Whether `e`'s casts keep every value of `range` apart and unchanged in order: to
/// an integer type that holds the range, or a float whose significand does.
fn holds_apart(e: &Arc<dyn PhysicalExpr>, [lo, hi]: [i64; 2]) -> bool {
    let target = if let Some(c) = e.downcast_ref::<CastExpr>() {
        if !holds_apart(c.expr(), [lo, hi]) {
            return false;
        }
        c.cast_type()
    } else if let Some(c) = e.downcast_ref::<TryCastExpr>() {
        if !holds_apart(c.expr(), [lo, hi]) {
            return false;
        }
        c.cast_type()
    } else {
        return true;
    };
    let within = |min: i64, max: i64| min <= lo && hi <= max;
    match target {
        DataType::Int8 => within(i8::MIN.into(), i8::MAX.into()),
        DataType::Int16 => within(i16::MIN.into(), i16::MAX.into()),
        DataType::Int32 | DataType::Date32 => within(i32::MIN.into(), i32::MAX.into()),
        DataType::Int64 => true,
        DataType::Float32 => within(-(1 << 24), 1 << 24),
        DataType::Float64 => within(-(1 << 53), 1 << 53),
        _ => false,
    }
}

/// The integer types whose values are packed (as `i64`).
fn integer(t: &DataType) -> bool {
    matches!(
        t,
        DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64 | DataType::Date32
    )
}

/// The table column that `plan`'s output column `i` is a copy of, through the
/// operators that pass values on unchanged.
fn source_name(plan: &Arc<dyn ExecutionPlan>, i: usize) -> Option<String> {
    if plan.name() == "DataSourceExec" && plan.children().is_empty() {
        return Some(plan.schema().fields().get(i)?.name().clone());
    }
    if let Some(p) = plan.downcast_ref::<ProjectionExec>() {
        let c = p.expr().get(i)?.expr.downcast_ref::<Column>()?;
        return source_name(p.input(), c.index());
    }
    if let Some(f) = plan.downcast_ref::<FilterExec>() {
        let i = match f.projection() {
            Some(p) => *p.get(i)?,
            None => i,
        };
        return source_name(f.input(), i);
    }
    let passes = plan.downcast_ref::<CoalescePartitionsExec>().is_some()
        || plan.downcast_ref::<RepartitionExec>().is_some()
        || plan.downcast_ref::<SortExec>().is_some()
        || plan.downcast_ref::<LocalLimitExec>().is_some()
        || plan.downcast_ref::<GlobalLimitExec>().is_some()
        || plan.downcast_ref::<KeyFilterExec>().is_some();
    match plan.children().as_slice() {
        [child] if passes => source_name(child, i),
        _ => None,
    }
}

/// The keys' columns packed into one `u64` per row (see the module).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct PackKeysExpr {
    keys: Vec<(Arc<dyn PhysicalExpr>, Digit)>,
}

impl fmt::Display for PackKeysExpr {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "pack(")?;
        for (i, (e, d)) in self.keys.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(
                f,
                "{e} in [{}, {}]",
                d.lo,
                d.lo as i128 + d.span as i128 - 1
            )?;
        }
        write!(f, ")")
    }
}

impl PhysicalExpr for PackKeysExpr {
    fn data_type(&self, _schema: &Schema) -> Result<DataType> {
        Ok(DataType::UInt64)
    }

    fn nullable(&self, _schema: &Schema) -> Result<bool> {
        Ok(false)
    }

    fn evaluate(&self, batch: &RecordBatch) -> Result<ColumnarValue> {
        let n = batch.num_rows();
        let mut packed = vec![0u64; n];
        for (e, d) in &self.keys {
            let a = e.evaluate(batch)?.into_array(n)?;
            let a = arrow::compute::cast(&a, &DataType::Int64)?;
            let a = a.as_primitive::<Int64Type>();
            let (lo, span, weight) = (d.lo, d.span, d.weight);
            // `v - lo`, wrapped, is `span` or more exactly when v < lo or v > hi.
            let mut outside = false;
            match a.nulls().filter(|n| n.null_count() > 0) {
                None => {
                    for (p, &v) in packed.iter_mut().zip(a.values()) {
                        let off = v.wrapping_sub(lo) as u64;
                        outside |= off >= span;
                        *p = p.wrapping_add(off.wrapping_add(1).wrapping_mul(weight));
                    }
                }
                Some(nulls) => {
                    for ((p, &v), valid) in packed.iter_mut().zip(a.values()).zip(nulls.iter()) {
                        let off = v.wrapping_sub(lo) as u64;
                        outside |= valid & (off >= span);
                        let digit = off.wrapping_add(1) * u64::from(valid);
                        *p = p.wrapping_add(digit.wrapping_mul(weight));
                    }
                }
            }
            if outside {
                return Err(DataFusionError::Execution(format!(
                    "a value of group key {e} lies outside [{lo}, {}], the range its Parquet footers give: the object's statistics are wrong",
                    lo as i128 + span as i128 - 1
                )));
            }
        }
        Ok(ColumnarValue::Array(Arc::new(UInt64Array::from(packed))))
    }

    fn children(&self) -> Vec<&Arc<dyn PhysicalExpr>> {
        self.keys.iter().map(|(e, _)| e).collect()
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn PhysicalExpr>>,
    ) -> Result<Arc<dyn PhysicalExpr>> {
        if children.len() != self.keys.len() {
            return Err(DataFusionError::Internal(
                "packed keys take one input per key".into(),
            ));
        }
        Ok(Arc::new(PackKeysExpr {
            keys: children
                .into_iter()
                .zip(&self.keys)
                .map(|(e, (_, d))| (e, *d))
                .collect(),
        }))
    }

    fn fmt_sql(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// One key taken back out of the packed column: its column's value (NULL for the
/// digit 0), then the key's expression over it.
#[derive(Debug, Clone)]
struct UnpackKeyExpr {
    packed: Arc<dyn PhysicalExpr>,
    digit: Digit,
    /// The key's column alone, as the expression reads it.
    raw: Arc<Schema>,
    /// The key's expression over `raw`.
    expr: Arc<dyn PhysicalExpr>,
    /// The key's field in the original aggregate's output.
    field: FieldRef,
}

impl PartialEq for UnpackKeyExpr {
    fn eq(&self, other: &Self) -> bool {
        self.packed.as_ref() == other.packed.as_ref()
            && self.digit == other.digit
            && self.expr.as_ref() == other.expr.as_ref()
            && self.field == other.field
    }
}

impl Eq for UnpackKeyExpr {}

impl Hash for UnpackKeyExpr {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.packed.hash(state);
        self.digit.hash(state);
        self.expr.hash(state);
        self.field.hash(state);
    }
}

impl fmt::Display for UnpackKeyExpr {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "unpack({}, {})", self.packed, self.expr)
    }
}

impl PhysicalExpr for UnpackKeyExpr {
    fn data_type(&self, _schema: &Schema) -> Result<DataType> {
        Ok(self.field.data_type().clone())
    }

    fn nullable(&self, _schema: &Schema) -> Result<bool> {
        Ok(self.field.is_nullable())
    }

    fn return_field(&self, _schema: &Schema) -> Result<FieldRef> {
        Ok(self.field.clone())
    }

    fn evaluate(&self, batch: &RecordBatch) -> Result<ColumnarValue> {
        let n = batch.num_rows();
        let p = self.packed.evaluate(batch)?.into_array(n)?;
        let Some(p) = p.as_primitive_opt::<UInt64Type>() else {
            return Err(DataFusionError::Internal(format!(
                "packed keys of type {}",
                p.data_type()
            )));
        };
        let Digit { lo, weight, .. } = self.digit;
        let radix = self.digit.radix();
        let values: Int64Array = p
            .values()
            .iter()
            .map(|&x| {
                let digit = (x / weight) % radix;
                (digit != 0).then(|| lo.wrapping_add((digit - 1) as i64))
            })
            .collect();
        let raw_type = self.raw.field(0).data_type();
        let column: ArrayRef = arrow::compute::cast(&values, raw_type)?;
        let raw = RecordBatch::try_new(self.raw.clone(), vec![column])?;
        let out = self.expr.evaluate(&raw)?.into_array(n)?;
        Ok(ColumnarValue::Array(out))
    }

    fn children(&self) -> Vec<&Arc<dyn PhysicalExpr>> {
        vec![&self.packed]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn PhysicalExpr>>,
    ) -> Result<Arc<dyn PhysicalExpr>> {
        let [packed] = &children[..] else {
            return Err(DataFusionError::Internal(
                "an unpacked key takes one input".into(),
            ));
        };
        Ok(Arc::new(UnpackKeyExpr {
            packed: packed.clone(),
            ..(*self).clone()
        }))
    }

    fn fmt_sql(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eval::{fragment_rules, sorted_rows};
    use arrow::array::{Date32Array, Float64Array, Int32Array, Int64Array, StringArray};
    use arrow::datatypes::Field;
    use datafusion::datasource::MemTable;
    use datafusion::execution::SessionStateBuilder;
    use datafusion::physical_plan::{collect, displayable};
    use datafusion::prelude::{SessionConfig, SessionContext};
    use proptest::prelude::*;

    /// Rows of `t`: a nullable Int32, an Int64, a Date32, a string and a float.
    type Row = (Option<i32>, i64, i32, u8, f64);

    /// A session over `t` in two partitions, planned with the fragments' rules (the
    /// partial aggregate kept).
    fn session(rows: &[Row]) -> SessionContext {
        let schema = Arc::new(Schema::new(vec![
            Field::new("a", DataType::Int32, true),
            Field::new("b", DataType::Int64, false),
            Field::new("d", DataType::Date32, false),
            Field::new("s", DataType::Utf8, false),
            Field::new("x", DataType::Float64, false),
        ]));
        let batch = |rows: &[Row]| {
            RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(Int32Array::from_iter(rows.iter().map(|r| r.0))) as ArrayRef,
                    Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.1))),
                    Arc::new(Date32Array::from_iter_values(rows.iter().map(|r| r.2))),
                    Arc::new(StringArray::from_iter_values(
                        rows.iter().map(|r| format!("s{}", r.3)),
                    )),
                    Arc::new(Float64Array::from_iter_values(rows.iter().map(|r| r.4))),
                ],
            )
            .unwrap()
        };
        let half = rows.len() / 2;
        let t = MemTable::try_new(
            schema.clone(),
            vec![vec![batch(&rows[..half])], vec![batch(&rows[half..])]],
        )
        .unwrap();
        let state = SessionStateBuilder::new()
            .with_default_features()
            .with_config(SessionConfig::new().with_target_partitions(2))
            .with_physical_optimizer_rules(fragment_rules())
            .build();
        let ctx = SessionContext::new_with_state(state);
        ctx.register_table("t", Arc::new(t)).unwrap();
        ctx
    }

    /// The exact ranges of `rows`' integer columns.
    fn ranges_of(rows: &[Row]) -> KeyRanges {
        let span = |v: Vec<i64>| [*v.iter().min().unwrap(), *v.iter().max().unwrap()];
        let mut r = KeyRanges::new();
        let a: Vec<i64> = rows.iter().filter_map(|r| r.0.map(i64::from)).collect();
        if !a.is_empty() {
            r.insert("a".into(), span(a));
        }
        r.insert("b".into(), span(rows.iter().map(|r| r.1).collect()));
        r.insert(
            "d".into(),
            span(rows.iter().map(|r| i64::from(r.2)).collect()),
        );
        r
    }

    /// `sql` planned, then packed with `ranges`: the plan as shown and its answer,
    /// beside the answer of the plan as DataFusion made it.
    async fn both(
        rows: &[Row],
        sql: &str,
        ranges: &KeyRanges,
    ) -> (String, Result<Vec<String>>, Vec<String>) {
        let ctx = session(rows);
        // A plan runs once (its repartitions' channels are taken): one plan each.
        let plan = || async {
            ctx.sql(sql)
                .await
                .unwrap()
                .create_physical_plan()
                .await
                .unwrap()
        };
        let want = sorted_rows(&collect(plan().await, ctx.task_ctx()).await.unwrap());
        let (plan, _) = packed(plan().await, ranges).unwrap();
        let shown = displayable(plan.as_ref()).indent(true).to_string();
        let got = collect(plan, ctx.task_ctx()).await.map(|b| sorted_rows(&b));
        (shown, got, want)
    }

    const QUERIES: [&str; 3] = [
        "SELECT a, b, count(*) AS n, sum(x) AS s, min(s) AS lo FROM t GROUP BY a, b",
        "SELECT CAST(b AS DOUBLE) AS bf, d, a, avg(x) AS m FROM t GROUP BY CAST(b AS DOUBLE), d, a",
        "SELECT d, CAST(a AS BIGINT) AS a64, max(s) AS ms FROM t WHERE x > 0.25 GROUP BY d, CAST(a AS BIGINT)",
    ];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// Packed or not, the same groups and states: NULL keys, negative ranges,
        /// dates, casts, filters and several partial streams.
        #[test]
        fn packed_keys_give_the_same_answers(
            rows in proptest::collection::vec(
                (proptest::option::of(-7i32..5), 1_000_000i64..1_000_040, -30i32..30, 0u8..4, 0f64..1.0),
                2..300,
            ),
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let ranges = ranges_of(&rows);
            for sql in QUERIES {
                let (shown, got, want) = rt.block_on(both(&rows, sql, &ranges));
                if ranges.contains_key("a") {
                    prop_assert!(shown.contains("pack("), "{sql}\n{shown}");
                }
                prop_assert_eq!(got.unwrap(), want, "{}\n{}", sql, shown);
            }
        }
    }

    #[tokio::test]
    async fn a_value_outside_its_footers_range_fails_the_query() {
        let rows: Vec<Row> = (0..100)
            .map(|i| (Some(i % 7), i64::from(i % 5), 0, 0, 0.5))
            .collect();
        let mut ranges = ranges_of(&rows);
        ranges.insert("a".into(), [0, 5]); // 6 occurs
        let (shown, got, _) = both(&rows, QUERIES[0], &ranges).await;
        assert!(shown.contains("pack("), "{shown}");
        let e = got.unwrap_err().to_string();
        assert!(e.contains("outside [0, 5]"), "{e}");
    }

    #[tokio::test]
    async fn keys_that_do_not_fit_stay_as_they_are() {
        let rows: Vec<Row> = (0..100)
            .map(|i| (Some(i), i64::from(i), 0, 0, 0.5))
            .collect();
        // A product of ranges past 2^64.
        let mut wide = ranges_of(&rows);
        wide.insert("a".into(), [i64::from(i32::MIN), i64::from(i32::MAX)]);
        wide.insert("b".into(), [i64::MIN / 2, i64::MAX / 2]);
        // A column without a range, a string key, one key only, a cast that merges.
        let ranges = ranges_of(&rows);
        let mut unknown = ranges.clone();
        unknown.remove("b");
        for (sql, r) in [
            (QUERIES[0], &wide),
            (QUERIES[0], &unknown),
            ("SELECT a, s, count(*) FROM t GROUP BY a, s", &ranges),
            ("SELECT b, count(*) FROM t GROUP BY b", &ranges),
            (
                "SELECT CAST(b AS SMALLINT) AS b16, a, count(*) FROM t GROUP BY CAST(b AS SMALLINT), a",
                &wide,
            ),
        ] {
            let (shown, got, want) = both(&rows, sql, r).await;
            assert!(!shown.contains("pack("), "{sql}\n{shown}");
            assert_eq!(got.unwrap(), want);
        }
    }
}
