//! `+`, `-` and `*` of 128-bit decimals without a checked multiply per value.
//!
//! arrow computes decimal arithmetic with overflow-checked 128-bit operations, one
//! per value (`i128::checked_mul` is a library call on x86-64), and DataFusion uses
//! the checked kernels for decimals even where it wraps integers. TPC-H's decimals
//! hold 15 digits, so a batch's products are nowhere near 128 bits:
//! [`DecimalArithExpr`] bounds each input's magnitude once per batch and, when no
//! value of the result can overflow, computes with wrapping operations (exact there),
//! which the compiler keeps inline and vectorises. Otherwise it runs arrow's checked
//! kernel, so overflow fails as it did. The result's type is arrow's, and
//! [`FastDecimal`] only swaps an expression in where that is the type DataFusion
//! planned.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, Datum, PrimitiveArray, new_empty_array};
use arrow::compute::kernels::numeric;
use arrow::datatypes::{DataType, Decimal128Type, Schema};
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode};
use datafusion::common::{DataFusionError, Result, ScalarValue};
use datafusion::logical_expr::{ColumnarValue, Operator};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::BinaryExpr;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::aggregates::AggregateExec;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::projection::{ProjectionExec, ProjectionExpr};

/// The operations [`DecimalArithExpr`] computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Op {
    Add,
    Sub,
    Mul,
}

impl Op {
    fn of(op: &Operator) -> Option<Op> {
        match op {
            Operator::Plus => Some(Op::Add),
            Operator::Minus => Some(Op::Sub),
            Operator::Multiply => Some(Op::Mul),
            _ => None,
        }
    }

    fn symbol(self) -> &'static str {
        match self {
            Op::Add => "+",
            Op::Sub => "-",
            Op::Mul => "*",
        }
    }

    /// arrow's checked kernel (what DataFusion runs for decimals).
    fn checked(self, l: &dyn Datum, r: &dyn Datum) -> Result<ArrayRef> {
        Ok(match self {
            Op::Add => numeric::add(l, r)?,
            Op::Sub => numeric::sub(l, r)?,
            Op::Mul => numeric::mul(l, r)?,
        })
    }
}

/// `left op right` over two `Decimal128` inputs (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct DecimalArithExpr {
    left: Arc<dyn PhysicalExpr>,
    right: Arc<dyn PhysicalExpr>,
    op: Op,
    /// Scales of the inputs and `(precision, scale)` of the result.
    scales: (i8, i8),
    out: (u8, i8),
}

impl PartialEq for DecimalArithExpr {
    fn eq(&self, other: &Self) -> bool {
        self.left.as_ref() == other.left.as_ref()
            && self.right.as_ref() == other.right.as_ref()
            && self.op == other.op
            && self.scales == other.scales
            && self.out == other.out
    }
}

impl Eq for DecimalArithExpr {}

impl Hash for DecimalArithExpr {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.left.hash(state);
        self.right.hash(state);
        self.op.hash(state);
        self.scales.hash(state);
        self.out.hash(state);
    }
}

impl fmt::Display for DecimalArithExpr {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{} {} {}", self.left, self.op.symbol(), self.right)
    }
}

/// One input's values: a batch's array, or one value for every row.
enum Side<'a> {
    Values(&'a PrimitiveArray<Decimal128Type>),
    Scalar(i128),
}

impl Side<'_> {
    /// The largest magnitude among its values (NULL slots included: whatever they
    /// hold is computed and then masked).
    fn bound(&self) -> u128 {
        match self {
            Side::Values(a) => a.values().iter().fold(0, |m, v| m.max(v.unsigned_abs())),
            Side::Scalar(v) => v.unsigned_abs(),
        }
    }
}

impl DecimalArithExpr {
    /// The result when no value of it can overflow, computed with wrapping
    /// operations; `None` when some might (arrow's checked kernel decides then).
    fn unchecked(&self, l: &Side, r: &Side) -> Option<PrimitiveArray<Decimal128Type>> {
        let (bl, br) = (l.bound(), r.bound());
        // Add and subtract align both sides to the result's scale first.
        let (ml, mr) = match self.op {
            Op::Mul => (1, 1),
            Op::Add | Op::Sub => (
                10i128.checked_pow(u32::try_from(self.out.1 - self.scales.0).ok()?)?,
                10i128.checked_pow(u32::try_from(self.out.1 - self.scales.1).ok()?)?,
            ),
        };
        let fits = match self.op {
            Op::Mul => bl.checked_mul(br),
            Op::Add | Op::Sub => bl
                .checked_mul(ml as u128)
                .zip(br.checked_mul(mr as u128))
                .and_then(|(a, b)| a.checked_add(b)),
        }
        .is_some_and(|m| m <= i128::MAX as u128);
        if !fits {
            return None;
        }
        let f = move |a: i128, b: i128| match self.op {
            Op::Mul => a.wrapping_mul(b),
            Op::Add => a.wrapping_mul(ml).wrapping_add(b.wrapping_mul(mr)),
            Op::Sub => a.wrapping_mul(ml).wrapping_sub(b.wrapping_mul(mr)),
        };
        let out = match (l, r) {
            (Side::Values(a), Side::Values(b)) => arrow::compute::binary(*a, *b, f).ok()?,
            (Side::Values(a), Side::Scalar(s)) => a.unary(|v| f(v, *s)),
            (Side::Scalar(s), Side::Values(b)) => b.unary(|v| f(*s, v)),
            (Side::Scalar(_), Side::Scalar(_)) => return None,
        };
        out.with_precision_and_scale(self.out.0, self.out.1).ok()
    }
}

/// An evaluated input as a [`Side`]: `None` for a NULL scalar or another type.
fn side(v: &ColumnarValue) -> Option<Side<'_>> {
    match v {
        ColumnarValue::Array(a) => a.as_primitive_opt::<Decimal128Type>().map(Side::Values),
        ColumnarValue::Scalar(ScalarValue::Decimal128(Some(v), _, _)) => Some(Side::Scalar(*v)),
        ColumnarValue::Scalar(_) => None,
    }
}

impl PhysicalExpr for DecimalArithExpr {
    fn data_type(&self, _schema: &Schema) -> Result<DataType> {
        Ok(DataType::Decimal128(self.out.0, self.out.1))
    }

    fn nullable(&self, schema: &Schema) -> Result<bool> {
        Ok(self.left.nullable(schema)? || self.right.nullable(schema)?)
    }

    fn evaluate(&self, batch: &arrow::record_batch::RecordBatch) -> Result<ColumnarValue> {
        let l = self.left.evaluate(batch)?;
        let r = self.right.evaluate(batch)?;
        if let (Some(ls), Some(rs)) = (side(&l), side(&r))
            && let Some(out) = self.unchecked(&ls, &rs)
        {
            return Ok(ColumnarValue::Array(Arc::new(out)));
        }
        let scalars = matches!(
            (&l, &r),
            (ColumnarValue::Scalar(_), ColumnarValue::Scalar(_))
        );
        let datum = |v: &ColumnarValue| -> Result<Box<dyn Datum>> {
            Ok(match v {
                ColumnarValue::Array(a) => Box::new(a.clone()),
                ColumnarValue::Scalar(s) => Box::new(s.to_scalar()?),
            })
        };
        let out = self.op.checked(datum(&l)?.as_ref(), datum(&r)?.as_ref())?;
        Ok(match scalars {
            true => ColumnarValue::Scalar(ScalarValue::try_from_array(&out, 0)?),
            false => ColumnarValue::Array(out),
        })
    }

    fn children(&self) -> Vec<&Arc<dyn PhysicalExpr>> {
        vec![&self.left, &self.right]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn PhysicalExpr>>,
    ) -> Result<Arc<dyn PhysicalExpr>> {
        let [left, right] = &children[..] else {
            return Err(DataFusionError::Internal(
                "decimal arithmetic takes two inputs".into(),
            ));
        };
        Ok(Arc::new(DecimalArithExpr {
            left: left.clone(),
            right: right.clone(),
            ..(*self).clone()
        }))
    }

    fn fmt_sql(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// `e` (over `schema`) with its decimal `+`, `-` and `*` computed by
/// [`DecimalArithExpr`] where its type is the one planned.
pub(crate) fn rewrite(
    e: Arc<dyn PhysicalExpr>,
    schema: &Schema,
) -> Result<Transformed<Arc<dyn PhysicalExpr>>> {
    e.transform_up(|e| {
        let Some(b) = e.downcast_ref::<BinaryExpr>() else {
            return Ok(Transformed::no(e));
        };
        let Some(op) = Op::of(b.op()) else {
            return Ok(Transformed::no(e));
        };
        let (Ok(lt), Ok(rt)) = (b.left().data_type(schema), b.right().data_type(schema)) else {
            return Ok(Transformed::no(e));
        };
        let (DataType::Decimal128(_, ls), DataType::Decimal128(_, rs)) = (&lt, &rt) else {
            return Ok(Transformed::no(e));
        };
        // The type arrow's kernel gives these inputs, which must be what was planned.
        let (l, r) = (new_empty_array(&lt), new_empty_array(&rt));
        let out = match op.checked(&l, &r).map(|a| a.data_type().clone()) {
            Ok(DataType::Decimal128(p, s))
                if e.data_type(schema).ok() == Some(DataType::Decimal128(p, s)) =>
            {
                (p, s)
            }
            _ => return Ok(Transformed::no(e)),
        };
        Ok(Transformed::yes(Arc::new(DecimalArithExpr {
            left: b.left().clone(),
            right: b.right().clone(),
            op,
            scales: (*ls, *rs),
            out,
        })))
    })
}

/// Physical rule: projections', filters' and aggregates' decimal arithmetic by
/// [`DecimalArithExpr`].
#[derive(Debug, Default)]
pub(crate) struct FastDecimal;

impl FastDecimal {
    fn node(p: Arc<dyn ExecutionPlan>) -> Result<Transformed<Arc<dyn ExecutionPlan>>> {
        if let Some(proj) = p.downcast_ref::<ProjectionExec>() {
            let schema = proj.input().schema();
            let mut changed = false;
            let exprs = proj
                .expr()
                .iter()
                .map(|pe| {
                    let t = rewrite(pe.expr.clone(), &schema)?;
                    changed |= t.transformed;
                    Ok(ProjectionExpr::new(t.data, pe.alias.clone()))
                })
                .collect::<Result<Vec<_>>>()?;
            if !changed {
                return Ok(Transformed::no(p));
            }
            let rebuilt = ProjectionExec::try_new(exprs, proj.input().clone())?;
            return Ok(Transformed::yes(Arc::new(rebuilt)));
        }
        if p.downcast_ref::<FilterExec>().is_some() {
            return crate::eval::rewrite::filter(p, rewrite);
        }
        if let Some(agg) = p.downcast_ref::<AggregateExec>() {
            let schema = agg.input_schema();
            let mut changed = false;
            let mut aggs = Vec::with_capacity(agg.aggr_expr().len());
            for a in agg.aggr_expr() {
                let args = a
                    .expressions()
                    .into_iter()
                    .map(|e| {
                        let t = rewrite(e, &schema)?;
                        changed |= t.transformed;
                        Ok(t.data)
                    })
                    .collect::<Result<Vec<_>>>()?;
                let order: Vec<_> = a.order_bys().iter().map(|s| s.expr.clone()).collect();
                match a.with_new_expressions(args, order) {
                    Some(new) => aggs.push(Arc::new(new)),
                    None => return Ok(Transformed::no(p)),
                }
            }
            if !changed {
                return Ok(Transformed::no(p));
            }
            return Ok(Transformed::yes(Arc::new(agg.with_new_aggr_exprs(aggs))));
        }
        Ok(Transformed::no(p))
    }
}

impl PhysicalOptimizerRule for FastDecimal {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(Self::node).data()
    }

    fn name(&self) -> &str {
        "FastDecimal"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Decimal128Array;
    use arrow::datatypes::Field;
    use arrow::record_batch::RecordBatch;
    use datafusion::physical_expr::expressions::{Column, Literal};
    use datafusion::prelude::SessionContext;
    use proptest::prelude::*;

    fn decimals(values: &[Option<i128>], p: u8, s: i8) -> ArrayRef {
        Arc::new(
            Decimal128Array::from(values.to_vec())
                .with_precision_and_scale(p, s)
                .unwrap(),
        )
    }

    /// `l op r` by DataFusion's `BinaryExpr` and by the rewritten expression: both
    /// answers (or both errors' presence), and whether it was rewritten.
    fn both(
        l: ArrayRef,
        r: Option<ArrayRef>,
        scalar: Option<ScalarValue>,
        op: Operator,
    ) -> (Result<ArrayRef>, Result<ArrayRef>, bool) {
        let mut fields = vec![Field::new("l", l.data_type().clone(), true)];
        let mut columns = vec![l.clone()];
        if let Some(r) = &r {
            fields.push(Field::new("r", r.data_type().clone(), true));
            columns.push(r.clone());
        }
        let schema = Arc::new(Schema::new(fields));
        let batch = RecordBatch::try_new(schema.clone(), columns).unwrap();
        let left: Arc<dyn PhysicalExpr> = Arc::new(Column::new("l", 0));
        let right: Arc<dyn PhysicalExpr> = match scalar {
            Some(s) => Arc::new(Literal::new(s)),
            None => Arc::new(Column::new("r", 1)),
        };
        let theirs: Arc<dyn PhysicalExpr> = Arc::new(BinaryExpr::new(left, op, right));
        let ours = rewrite(theirs.clone(), &schema).unwrap();
        let run = |e: &Arc<dyn PhysicalExpr>| {
            e.evaluate(&batch)
                .and_then(|v| v.into_array(batch.num_rows()))
        };
        (run(&theirs), run(&ours.data), ours.transformed)
    }

    fn op_of(i: u8) -> Operator {
        [Operator::Plus, Operator::Minus, Operator::Multiply][usize::from(i % 3)]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn answers_equal_arrows_checked_kernels(
            values in proptest::collection::vec(
                (proptest::option::of(any::<i64>()), proptest::option::of(any::<i64>())), 0..40),
            shift in 0u32..70,
            (s1, s2) in (0i8..6, 0i8..6),
            op in 0u8..3,
            scalar in proptest::option::of(any::<i64>()),
        ) {
            // Magnitudes from small to past what 128 bits hold once multiplied.
            let widen = |v: Option<i64>| v.map(|v| i128::from(v) << shift.min(60));
            let l: Vec<_> = values.iter().map(|(a, _)| widen(*a)).collect();
            let r: Vec<_> = values.iter().map(|(_, b)| widen(*b)).collect();
            let op = op_of(op);
            let (theirs, ours, rewritten) = match scalar {
                None => both(decimals(&l, 38, s1), Some(decimals(&r, 38, s2)), None, op),
                Some(v) => both(
                    decimals(&l, 38, s1),
                    None,
                    Some(ScalarValue::Decimal128(Some(i128::from(v)), 20, s2)),
                    op,
                ),
            };
            prop_assert!(rewritten);
            match (theirs, ours) {
                (Ok(a), Ok(b)) => {
                    prop_assert_eq!(a.data_type(), b.data_type());
                    prop_assert_eq!(a.as_ref(), b.as_ref());
                }
                (Err(_), Err(_)) => {}
                (a, b) => prop_assert!(false, "DataFusion {:?}, ours {:?}", a, b),
            }
        }
    }

    #[test]
    fn overflow_still_fails() {
        let big = decimals(&[Some(i128::MAX / 3), Some(1)], 38, 0);
        let (theirs, ours, rewritten) = both(big.clone(), Some(big), None, Operator::Multiply);
        assert!(rewritten);
        assert!(theirs.is_err());
        let e = ours.unwrap_err().to_string();
        assert!(e.contains("Overflow") || e.contains("overflow"), "{e}");
    }

    #[test]
    fn other_types_and_operators_stay_datafusions() {
        let ints: ArrayRef = Arc::new(arrow::array::Int64Array::from(vec![1, 2]));
        let (_, _, rewritten) = both(ints.clone(), Some(ints), None, Operator::Multiply);
        assert!(!rewritten);
        let d = decimals(&[Some(1)], 10, 2);
        let (_, _, rewritten) = both(d.clone(), Some(d), None, Operator::Divide);
        assert!(!rewritten);
    }

    #[test]
    fn tpch_q1_arithmetic_is_rewritten_and_answers_the_same() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let ctx = SessionContext::new();
            let sql = "SELECT f, sum(p * (1 - d)) AS a, sum(p * (1 - d) * (1 + t)) AS b, \
                       avg(d) AS c FROM (VALUES \
                       ('A', CAST(901.00 AS DECIMAL(15,2)), CAST(0.05 AS DECIMAL(15,2)), CAST(0.02 AS DECIMAL(15,2))), \
                       ('A', CAST(123456.78 AS DECIMAL(15,2)), CAST(0.10 AS DECIMAL(15,2)), CAST(0.08 AS DECIMAL(15,2))), \
                       ('B', NULL, CAST(0.00 AS DECIMAL(15,2)), CAST(0.01 AS DECIMAL(15,2)))) v(f, p, d, t) \
                       GROUP BY f ORDER BY f";
            let plan = ctx.sql(sql).await.unwrap().create_physical_plan().await.unwrap();
            let before = datafusion::physical_plan::collect(plan.clone(), ctx.task_ctx())
                .await
                .unwrap();
            let swapped = plan.transform_up(FastDecimal::node).unwrap();
            assert!(swapped.transformed, "Q1's decimal arithmetic was not swapped in");
            let plan = swapped.data;
            let again = plan.clone().transform_up(FastDecimal::node).unwrap();
            assert!(!again.transformed, "some decimal arithmetic was left");
            let after = datafusion::physical_plan::collect(plan, ctx.task_ctx())
                .await
                .unwrap();
            assert_eq!(before, after);
            assert_eq!(after[0].num_rows(), 2);
        });
    }
}
