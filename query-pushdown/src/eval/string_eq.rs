//! `column = 'literal'` (and `<>`) over string views, for literals of at most 12
//! bytes, as one 128-bit comparison per row.
//!
//! A string view of at most 12 bytes holds its length and its bytes, zero-padded, in
//! the view itself, so a row equals such a literal exactly when its view equals the
//! literal's view (arrow's own comparison relies on the same layout). arrow compares
//! views through a per-row comparator that checks buffers, lengths and prefixes in
//! turn; on TPC-H's `l_shipmode = 'MAIL' OR l_shipmode = 'SHIP'` (Q12, 6 million rows)
//! that comparison was the largest single cost of the node's fragment.
//! [`ShortStringEqExpr`] compares the views directly, which the compiler vectorises.
//! [`FastStringEq`] swaps it in for the fragments' filters.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use arrow::array::{Array, AsArray, BooleanArray, RecordBatch, StringViewArray};
use arrow::buffer::BooleanBuffer;
use arrow::datatypes::{DataType, Schema};
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{DataFusionError, Result, ScalarValue};
use datafusion::logical_expr::{ColumnarValue, Operator};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::{BinaryExpr, Literal};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::ExecutionPlan;

/// Longest literal whose view holds all its bytes.
const INLINE: usize = 12;

/// `expr = literal` (or `<>`) over a string-view `expr`, `literal` at most 12 bytes.
#[derive(Debug, Clone)]
pub(crate) struct ShortStringEqExpr {
    expr: Arc<dyn PhysicalExpr>,
    literal: String,
    /// The literal's view: what every equal row's view is.
    view: u128,
    negated: bool,
}

impl ShortStringEqExpr {
    /// `expr = literal` (`<>` when `negated`); `None` when the literal is longer than
    /// a view holds.
    pub(crate) fn new(expr: Arc<dyn PhysicalExpr>, literal: &str, negated: bool) -> Option<Self> {
        if literal.len() > INLINE {
            return None;
        }
        let view = *StringViewArray::from_iter_values([literal])
            .views()
            .first()?;
        Some(ShortStringEqExpr {
            expr,
            literal: literal.to_string(),
            view,
            negated,
        })
    }
}

impl PartialEq for ShortStringEqExpr {
    fn eq(&self, other: &Self) -> bool {
        self.expr.as_ref() == other.expr.as_ref()
            && self.literal == other.literal
            && self.negated == other.negated
    }
}

impl Eq for ShortStringEqExpr {}

impl Hash for ShortStringEqExpr {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.expr.hash(state);
        self.literal.hash(state);
        self.negated.hash(state);
    }
}

impl fmt::Display for ShortStringEqExpr {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let op = if self.negated { "!=" } else { "=" };
        write!(f, "{} {op} '{}' (view)", self.expr, self.literal)
    }
}

impl PhysicalExpr for ShortStringEqExpr {
    fn data_type(&self, _schema: &Schema) -> Result<DataType> {
        Ok(DataType::Boolean)
    }

    fn nullable(&self, schema: &Schema) -> Result<bool> {
        self.expr.nullable(schema)
    }

    fn evaluate(&self, batch: &RecordBatch) -> Result<ColumnarValue> {
        let a = self.expr.evaluate(batch)?.into_array(batch.num_rows())?;
        let Some(v) = a.as_string_view_opt() else {
            return Err(DataFusionError::Internal(format!(
                "string view comparison over {}",
                a.data_type()
            )));
        };
        let views = v.views();
        let (target, negated) = (self.view, self.negated);
        let values = BooleanBuffer::collect_bool(views.len(), |i| (views[i] == target) != negated);
        Ok(ColumnarValue::Array(Arc::new(BooleanArray::new(
            values,
            v.logical_nulls(),
        ))))
    }

    fn children(&self) -> Vec<&Arc<dyn PhysicalExpr>> {
        vec![&self.expr]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn PhysicalExpr>>,
    ) -> Result<Arc<dyn PhysicalExpr>> {
        let [expr] = &children[..] else {
            return Err(DataFusionError::Internal(
                "a string comparison takes one input".into(),
            ));
        };
        Ok(Arc::new(ShortStringEqExpr {
            expr: expr.clone(),
            ..(*self).clone()
        }))
    }

    fn fmt_sql(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// The string of a string literal.
fn literal_str(e: &Arc<dyn PhysicalExpr>) -> Option<&str> {
    match e.downcast_ref::<Literal>()?.value() {
        ScalarValue::Utf8View(Some(s)) | ScalarValue::Utf8(Some(s)) => Some(s),
        _ => None,
    }
}

/// `e` (over `schema`) with its short-literal string-view comparisons swapped for
/// [`ShortStringEqExpr`].
pub(crate) fn rewrite(
    e: Arc<dyn PhysicalExpr>,
    schema: &Schema,
) -> Result<Transformed<Arc<dyn PhysicalExpr>>> {
    e.transform(|e| {
        let Some(b) = e.downcast_ref::<BinaryExpr>() else {
            return Ok(Transformed::no(e));
        };
        let negated = match b.op() {
            Operator::Eq => false,
            Operator::NotEq => true,
            _ => return Ok(Transformed::no(e)),
        };
        let (expr, literal) = match (literal_str(b.left()), literal_str(b.right())) {
            (None, Some(s)) => (b.left(), s),
            (Some(s), None) => (b.right(), s),
            _ => return Ok(Transformed::no(e)),
        };
        if expr.data_type(schema).ok() != Some(DataType::Utf8View) {
            return Ok(Transformed::no(e));
        }
        match ShortStringEqExpr::new(expr.clone(), literal, negated) {
            Some(fast) => Ok(Transformed::yes(Arc::new(fast))),
            None => Ok(Transformed::no(e)),
        }
    })
}

/// Physical rule: filters' short-literal string-view comparisons by
/// [`ShortStringEqExpr`].
#[derive(Debug, Default)]
pub(crate) struct FastStringEq;

impl PhysicalOptimizerRule for FastStringEq {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        crate::eval::rewrite::filters(plan, rewrite)
    }

    fn name(&self) -> &str {
        "FastStringEq"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::ArrayRef;
    use arrow::datatypes::Field;
    use datafusion::physical_expr::expressions::{Column, binary, lit};
    use datafusion::prelude::SessionContext;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]
        /// Equal to arrow's comparison on every row, NULLs included, for views
        /// built in several ways (inline, long strings beside them, sliced).
        #[test]
        fn answers_equal_arrows_comparison(
            values in proptest::collection::vec(proptest::option::of("[ab é]{0,14}"), 1..40),
            literal in "[ab é]{0,12}",
            negated in any::<bool>(),
            offset in 0usize..5,
        ) {
            prop_assume!(literal.len() <= INLINE);
            let all: ArrayRef = Arc::new(StringViewArray::from(values.clone()));
            let offset = offset.min(values.len() - 1);
            let sliced = all.slice(offset, values.len() - offset);
            let schema = Arc::new(Schema::new(vec![Field::new("s", DataType::Utf8View, true)]));
            let batch = RecordBatch::try_new(schema.clone(), vec![sliced]).unwrap();
            let op = if negated { Operator::NotEq } else { Operator::Eq };
            let column: Arc<dyn PhysicalExpr> = Arc::new(Column::new("s", 0));
            let l = lit(ScalarValue::Utf8View(Some(literal.clone())));
            for theirs in [
                binary(column.clone(), op, l.clone(), &schema).unwrap(),
                binary(l.clone(), op, column.clone(), &schema).unwrap(),
            ] {
                let ours = rewrite(theirs.clone(), &schema).unwrap();
                prop_assert!(ours.transformed);
                let run = |e: &Arc<dyn PhysicalExpr>| {
                    e.evaluate(&batch).unwrap().into_array(batch.num_rows()).unwrap()
                };
                let (a, b) = (run(&theirs), run(&ours.data));
                prop_assert_eq!(a.as_ref(), b.as_ref());
            }
        }
    }

    #[test]
    fn long_literals_and_other_types_stay_datafusions() {
        let schema = Schema::new(vec![
            Field::new("s", DataType::Utf8View, true),
            Field::new("u", DataType::Utf8, true),
        ]);
        let view: Arc<dyn PhysicalExpr> = Arc::new(Column::new("s", 0));
        let long = lit(ScalarValue::Utf8View(Some("thirteen byte".into())));
        let e = binary(view, Operator::Eq, long, &schema).unwrap();
        assert!(!rewrite(e, &schema).unwrap().transformed);
        let plain: Arc<dyn PhysicalExpr> = Arc::new(Column::new("u", 1));
        let e = binary(plain, Operator::Eq, lit("MAIL"), &schema).unwrap();
        assert!(!rewrite(e, &schema).unwrap().transformed);
    }

    #[test]
    fn a_fragment_filter_compares_views() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let ctx = SessionContext::new();
            let df = ctx
                .sql("SELECT * FROM (VALUES (arrow_cast('MAIL', 'Utf8View')), (arrow_cast('SHIP', 'Utf8View')), \
                      (arrow_cast('a string past twelve bytes', 'Utf8View')), (NULL)) t(c) \
                      WHERE c = 'MAIL' OR c = 'SHIP'")
                .await
                .unwrap();
            let plan = df.create_physical_plan().await.unwrap();
            let before = datafusion::physical_plan::collect(plan.clone(), ctx.task_ctx())
                .await
                .unwrap();
            let plan = FastStringEq.optimize(plan, &ConfigOptions::default()).unwrap();
            let shown = datafusion::physical_plan::displayable(plan.as_ref())
                .indent(true)
                .to_string();
            assert!(shown.contains("(view)"), "{shown}");
            let after = datafusion::physical_plan::collect(plan, ctx.task_ctx())
                .await
                .unwrap();
            assert_eq!(before, after);
            let rows: usize = after.iter().map(|b| b.num_rows()).sum();
            assert_eq!(rows, 2);
        });
    }
}
