//! `LIKE` patterns of several literal pieces (`'%special%requests%'`), matched with
//! substring searches instead of a regular expression.
//!
//! arrow's `LIKE` kernel matches a pattern that is one literal, a prefix, a suffix or
//! one `%…%` piece directly, and compiles anything else into a regex, once per batch,
//! which costs more than the scan around it (TPC-H Q13's
//! `o_comment NOT LIKE '%special%requests%'`). Without `_` or an escape, such a pattern
//! is a prefix, pieces in order, and a suffix; the leftmost match of each piece leaves
//! the most room for the next, so a greedy search decides it exactly, on bytes (a
//! UTF-8 piece only matches at character boundaries). [`FastLike`] swaps these in
//! for the fragments' filters; everything else stays DataFusion's.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use arrow::array::{Array, AsArray, BooleanArray, RecordBatch};
use arrow::buffer::BooleanBuffer;
use arrow::datatypes::{DataType, Schema};
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{Result, ScalarValue};
use datafusion::logical_expr::ColumnarValue;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::{LikeExpr, Literal};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::ExecutionPlan;
use memchr::memmem::Finder;

/// A pattern split at its `%`s: `prefix%piece%…%suffix` (prefix and suffix may be
/// empty; at least one `%`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Pieces {
    prefix: String,
    middle: Vec<String>,
    suffix: String,
}

impl Pieces {
    /// The pieces of `pattern`, when a regex would otherwise match it and substring
    /// searches can: no `_`, no escape, and more than arrow matches directly.
    pub(crate) fn of(pattern: &str) -> Option<Pieces> {
        if pattern.contains(['_', '\\']) {
            return None;
        }
        let parts: Vec<&str> = pattern.split('%').collect();
        let (prefix, rest) = parts.split_first()?;
        let (suffix, middle) = rest.split_last()?;
        let middle: Vec<String> = middle
            .iter()
            .filter(|p| !p.is_empty())
            .map(|p| p.to_string())
            .collect();
        // One piece at most, anchored on at most one side: arrow's own fast paths.
        let anchors = usize::from(!prefix.is_empty()) + usize::from(!suffix.is_empty());
        if middle.len() + anchors <= 1 {
            return None;
        }
        Some(Pieces {
            prefix: prefix.to_string(),
            middle,
            suffix: suffix.to_string(),
        })
    }
}

/// `expr [NOT] LIKE pattern` for a [`Pieces`] pattern.
#[derive(Debug, Clone)]
pub(crate) struct PiecesLikeExpr {
    expr: Arc<dyn PhysicalExpr>,
    pieces: Pieces,
    negated: bool,
    finders: Arc<Vec<Finder<'static>>>,
}

impl PiecesLikeExpr {
    /// `expr [NOT] LIKE` the pattern of `pieces`.
    pub(crate) fn new(expr: Arc<dyn PhysicalExpr>, pieces: Pieces, negated: bool) -> Self {
        let finders = pieces
            .middle
            .iter()
            .map(|p| Finder::new(p.as_bytes()).into_owned())
            .collect();
        PiecesLikeExpr {
            expr,
            pieces,
            negated,
            finders: Arc::new(finders),
        }
    }

    fn matches(&self, s: &[u8]) -> bool {
        let p = &self.pieces;
        let Some(mut rest) = s.strip_prefix(p.prefix.as_bytes()) else {
            return false;
        };
        for f in self.finders.iter() {
            match f.find(rest) {
                Some(i) => rest = &rest[i + f.needle().len()..],
                None => return false,
            }
        }
        rest.ends_with(p.suffix.as_bytes())
    }

    /// The answer for each of `n` values (`value(i)`; NULLs are answered by the
    /// caller's null buffer).
    fn mask<'a>(&self, n: usize, value: impl Fn(usize) -> &'a str) -> BooleanBuffer {
        BooleanBuffer::collect_bool(n, |i| self.matches(value(i).as_bytes()) != self.negated)
    }
}

impl PartialEq for PiecesLikeExpr {
    fn eq(&self, other: &Self) -> bool {
        self.expr.as_ref() == other.expr.as_ref()
            && self.pieces == other.pieces
            && self.negated == other.negated
    }
}

impl Eq for PiecesLikeExpr {}

impl Hash for PiecesLikeExpr {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.expr.hash(state);
        self.pieces.hash(state);
        self.negated.hash(state);
    }
}

impl fmt::Display for PiecesLikeExpr {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let p = &self.pieces;
        let mut pattern = p.prefix.clone();
        for m in &p.middle {
            pattern.push('%');
            pattern.push_str(m);
        }
        pattern.push('%');
        pattern.push_str(&p.suffix);
        let not = if self.negated { "NOT " } else { "" };
        write!(f, "{} {not}LIKE '{pattern}' (pieces)", self.expr)
    }
}

impl PhysicalExpr for PiecesLikeExpr {
    fn data_type(&self, _schema: &Schema) -> Result<DataType> {
        Ok(DataType::Boolean)
    }

    fn nullable(&self, schema: &Schema) -> Result<bool> {
        self.expr.nullable(schema)
    }

    fn evaluate(&self, batch: &RecordBatch) -> Result<ColumnarValue> {
        let a = self.expr.evaluate(batch)?.into_array(batch.num_rows())?;
        let n = a.len();
        let values = match a.data_type() {
            DataType::Utf8View => {
                let v = a.as_string_view();
                self.mask(n, |i| v.value(i))
            }
            DataType::Utf8 => {
                let v = a.as_string::<i32>();
                self.mask(n, |i| v.value(i))
            }
            DataType::LargeUtf8 => {
                let v = a.as_string::<i64>();
                self.mask(n, |i| v.value(i))
            }
            other => {
                return Err(datafusion::common::DataFusionError::Internal(format!(
                    "LIKE over {other}"
                )));
            }
        };
        let mask = BooleanArray::new(values, a.logical_nulls());
        Ok(ColumnarValue::Array(Arc::new(mask)))
    }

    fn children(&self) -> Vec<&Arc<dyn PhysicalExpr>> {
        vec![&self.expr]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn PhysicalExpr>>,
    ) -> Result<Arc<dyn PhysicalExpr>> {
        let [expr] = &children[..] else {
            return Err(datafusion::common::DataFusionError::Internal(
                "LIKE takes one input".into(),
            ));
        };
        Ok(Arc::new(PiecesLikeExpr {
            expr: expr.clone(),
            ..(*self).clone()
        }))
    }

    fn fmt_sql(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// `e` (over `schema`) with its [`Pieces`] `LIKE`s matched by substring search.
pub(crate) fn rewrite(
    e: Arc<dyn PhysicalExpr>,
    schema: &Schema,
) -> Result<Transformed<Arc<dyn PhysicalExpr>>> {
    e.transform(|e| {
        let Some(like) = e.downcast_ref::<LikeExpr>() else {
            return Ok(Transformed::no(e));
        };
        let string_input = matches!(
            like.expr().data_type(schema),
            Ok(DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View)
        );
        let pattern = like
            .pattern()
            .downcast_ref::<Literal>()
            .and_then(|l| match l.value() {
                ScalarValue::Utf8(Some(p))
                | ScalarValue::LargeUtf8(Some(p))
                | ScalarValue::Utf8View(Some(p)) => Pieces::of(p),
                _ => None,
            });
        match pattern {
            Some(pieces) if string_input && !like.case_insensitive() => {
                Ok(Transformed::yes(Arc::new(PiecesLikeExpr::new(
                    like.expr().clone(),
                    pieces,
                    like.negated(),
                ))))
            }
            _ => Ok(Transformed::no(e)),
        }
    })
}

/// Physical rule: filters' [`Pieces`] `LIKE`s matched by substring search.
#[derive(Debug, Default)]
pub(crate) struct FastLike;

impl PhysicalOptimizerRule for FastLike {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        crate::eval::rewrite::filters(plan, rewrite)
    }

    fn name(&self) -> &str {
        "FastLike"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{ArrayRef, StringArray, StringViewArray};
    use arrow::datatypes::Field;
    use datafusion::physical_expr::expressions::{Column, like, lit};
    use datafusion::prelude::SessionContext;
    use proptest::prelude::*;

    #[test]
    fn only_patterns_that_need_a_regex_are_split() {
        for direct in [
            "abc", "abc%", "%abc", "%abc%", "%", "%%", "a_c%x%", "%a\\%b%",
        ] {
            assert_eq!(Pieces::of(direct), None, "{direct}");
        }
        let p = Pieces::of("%special%requests%").unwrap();
        assert_eq!(p.prefix, "");
        assert_eq!(p.middle, ["special", "requests"]);
        assert_eq!(p.suffix, "");
        let p = Pieces::of("a%%b").unwrap();
        assert_eq!(
            (p.prefix.as_str(), p.middle.len(), p.suffix.as_str()),
            ("a", 0, "b")
        );
        assert!(Pieces::of("%a%b").is_some());
        assert!(Pieces::of("a%b%").is_some());
    }

    fn values_type(schema: &Schema) -> DataType {
        schema.field(0).data_type().clone()
    }

    /// `[NOT] LIKE pattern` over `values` by DataFusion's own expression and by
    /// [`PiecesLikeExpr`].
    fn both(values: ArrayRef, pattern: &str, negated: bool) -> (BooleanArray, BooleanArray) {
        let schema = Arc::new(Schema::new(vec![Field::new(
            "s",
            values.data_type().clone(),
            true,
        )]));
        let batch = RecordBatch::try_new(schema.clone(), vec![values]).unwrap();
        let column: Arc<dyn PhysicalExpr> = Arc::new(Column::new("s", 0));
        let pattern = match values_type(&schema) {
            DataType::Utf8View => lit(ScalarValue::Utf8View(Some(pattern.to_string()))),
            _ => lit(pattern),
        };
        let theirs = like(negated, false, column.clone(), pattern.clone(), &schema).unwrap();
        let ours = rewrite(theirs.clone(), &schema).unwrap();
        assert!(ours.transformed, "{pattern:?} was not rewritten");
        let run = |e: &Arc<dyn PhysicalExpr>| {
            e.evaluate(&batch)
                .unwrap()
                .into_array(batch.num_rows())
                .unwrap()
                .as_boolean()
                .clone()
        };
        (run(&theirs), run(&ours.data))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]
        #[test]
        fn answers_equal_the_regex(
            values in proptest::collection::vec(proptest::option::of("[abé%]{0,12}"), 0..40),
            pattern in "[abé]{0,2}%[abé%]{0,4}%[abé]{0,2}",
            negated in any::<bool>(),
        ) {
            prop_assume!(Pieces::of(&pattern).is_some());
            let view: ArrayRef = Arc::new(StringViewArray::from(values.clone()));
            let (theirs, ours) = both(view, &pattern, negated);
            prop_assert_eq!(&theirs, &ours);
            let plain: ArrayRef = Arc::new(StringArray::from(values));
            let (theirs, ours) = both(plain, &pattern, negated);
            prop_assert_eq!(theirs, ours);
        }
    }

    #[test]
    fn a_fragment_filter_uses_the_pieces() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let ctx = SessionContext::new();
            let df = ctx
                .sql("SELECT * FROM (VALUES ('special big requests'), ('requests special'), (NULL)) t(c) WHERE c NOT LIKE '%special%requests%'")
                .await
                .unwrap();
            let plan = df.create_physical_plan().await.unwrap();
            let before = datafusion::physical_plan::collect(plan.clone(), ctx.task_ctx())
                .await
                .unwrap();
            let plan = FastLike.optimize(plan, &ConfigOptions::default()).unwrap();
            let shown = datafusion::physical_plan::displayable(plan.as_ref())
                .indent(true)
                .to_string();
            assert!(shown.contains("(pieces)"), "{shown}");
            let after = datafusion::physical_plan::collect(plan, ctx.task_ctx())
                .await
                .unwrap();
            assert_eq!(before, after);
            let rows: usize = after.iter().map(|b| b.num_rows()).sum();
            assert_eq!(rows, 1, "only 'requests special' is NOT LIKE; NULL is neither");
        });
    }
}
