//! Which expressions a storage node evaluates exactly as the compute tier would.
//!
//! The node runs the same DataFusion, so every built-in, non-volatile scalar function
//! gives the same answer there. Not pushable: volatile functions (`random()`), user
//! functions the node does not have, subqueries, aggregates and windows (aggregates
//! are pushed separately, as partial aggregates), placeholders and outer references.

use std::sync::OnceLock;

use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::execution::{FunctionRegistry, SessionState, SessionStateBuilder};
use datafusion::logical_expr::{Expr, Volatility};
use datafusion_substrait::logical_plan::consumer::{name_to_op, substrait_to_df_name};
use datafusion_substrait::logical_plan::producer::operator_to_name;

/// Substrait names DataFusion's consumer builds into expressions itself (its
/// `BuiltinExprBuilder`, which it does not export).
const BUILTIN_EXPRESSIONS: &[&str] = &[
    "not",
    "like",
    "ilike",
    "like_match",
    "like_imatch",
    "like_not_match",
    "like_not_imatch",
    "is_null",
    "is_not_null",
    "is_true",
    "is_false",
    "is_not_true",
    "is_not_false",
    "is_unknown",
    "is_not_unknown",
    "negative",
    "negate",
    "and_not",
    "xor",
    "between",
    "logb",
];

/// The session whose function registry a node plans fragments with (the default
/// features, as [`crate::eval::fragment_session`] builds).
fn registry() -> &'static SessionState {
    static STATE: OnceLock<SessionState> = OnceLock::new();
    STATE.get_or_init(|| SessionStateBuilder::new().with_default_features().build())
}

/// Whether a storage node evaluates the Substrait function `name` (without its
/// `:signature` suffix), exactly as the compute tier would: a name DataFusion's
/// Substrait consumer maps to an operator or builds itself, or a non-volatile scalar
/// function of the node's registry. The one definition both sides use: the node
/// refuses a fragment calling anything else, and the compute tier pushes nothing
/// that does.
pub(crate) fn node_evaluates(name: &str) -> bool {
    let udf = registry()
        .udf(name)
        .ok()
        .or_else(|| substrait_to_df_name(name).and_then(|n| registry().udf(n).ok()));
    match udf {
        Some(f) => f.signature().volatility != Volatility::Volatile,
        None => name_to_op(name).is_some() || BUILTIN_EXPRESSIONS.contains(&name),
    }
}

/// True when every part of `e` is of a kind a node evaluates exactly: columns,
/// literals, the operators and functions of `node_evaluates`, casts, CASE, IN
/// lists. (Whether the encoded fragment as a whole fits the node's limits is
/// checked on the fragment: [`validate`](crate::wire::fragment::validate).)
pub fn pushable(e: &Expr) -> bool {
    let mut ok = true;
    let _ = e.apply(|x| {
        let fine = match x {
            Expr::Column(_)
            | Expr::Literal(..)
            | Expr::Alias(_)
            | Expr::Not(_)
            | Expr::IsNull(_)
            | Expr::IsNotNull(_)
            | Expr::IsTrue(_)
            | Expr::IsFalse(_)
            | Expr::IsNotTrue(_)
            | Expr::IsNotFalse(_)
            | Expr::IsUnknown(_)
            | Expr::IsNotUnknown(_)
            | Expr::Negative(_)
            | Expr::Between(_)
            | Expr::Like(_)
            | Expr::Case(_)
            | Expr::Cast(_)
            | Expr::InList(_) => true,
            Expr::BinaryExpr(b) => node_evaluates(operator_to_name(b.op)),
            Expr::ScalarFunction(f) => {
                f.func.signature().volatility != Volatility::Volatile
                    && (node_evaluates(f.func.name())
                        || crate::eval::wasm_fn::is_wasm_function(&f.func))
            }
            _ => false,
        };
        if fine {
            Ok(TreeNodeRecursion::Continue)
        } else {
            ok = false;
            Ok(TreeNodeRecursion::Stop)
        }
    });
    ok
}

/// True when `e` is a pushable aggregate: `sum`, `count`, `min`, `max` or `avg` of
/// pushable arguments, without DISTINCT, FILTER or ORDER BY.
pub(crate) fn pushable_aggregate(e: &Expr) -> bool {
    match e {
        Expr::Alias(a) => pushable_aggregate(&a.expr),
        Expr::AggregateFunction(f) => {
            let p = &f.params;
            crate::wire::fragment::AGGREGATES.contains(&f.func.name())
                && !p.distinct
                && p.filter.is_none()
                && p.order_by.is_empty()
                && p.args.iter().all(pushable)
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::datasource::MemTable;
    use datafusion::logical_expr::{BinaryExpr, Operator, col};
    use datafusion::prelude::SessionContext;
    use datafusion_substrait::logical_plan::consumer::from_substrait_plan;
    use datafusion_substrait::logical_plan::producer::to_substrait_plan;

    use super::*;
    use crate::wire::fragment::validate;

    #[test]
    fn every_registered_function_is_judged_by_its_volatility() {
        let state = registry();
        assert!(
            state.udfs().len() > 100,
            "the default features register the built-ins"
        );
        for name in state.udfs() {
            let f = state.udf(&name).unwrap();
            let volatile = f.signature().volatility == Volatility::Volatile;
            assert_eq!(node_evaluates(&name), !volatile, "{name}");
            for alias in f.aliases() {
                assert_eq!(node_evaluates(alias), !volatile, "{name} alias {alias}");
            }
        }
        assert!(!node_evaluates("no_such_function"));
    }

    /// For every binary operator over columns of every type it accepts: the compute
    /// tier pushes it exactly when the node's validation and Substrait consumer take
    /// it (`||` was pushed as `str_concat`, which the node could not read back).
    #[tokio::test]
    async fn the_compute_tier_pushes_exactly_the_operators_a_node_runs() {
        use Operator::*;
        let schema = Arc::new(Schema::new(vec![
            Field::new("i", DataType::Int64, true),
            Field::new("j", DataType::Int64, true),
            Field::new("s", DataType::Utf8, true),
            Field::new("u", DataType::Utf8, true),
            Field::new("b", DataType::Boolean, true),
            Field::new("c", DataType::Boolean, true),
        ]));
        let ctx = SessionContext::new();
        ctx.register_table(
            "t",
            Arc::new(MemTable::try_new(schema, vec![vec![]]).unwrap()),
        )
        .unwrap();
        let ops = [
            Eq,
            NotEq,
            Lt,
            LtEq,
            Gt,
            GtEq,
            Plus,
            Minus,
            Multiply,
            Divide,
            Modulo,
            And,
            Or,
            IsDistinctFrom,
            IsNotDistinctFrom,
            RegexMatch,
            RegexIMatch,
            RegexNotMatch,
            RegexNotIMatch,
            LikeMatch,
            ILikeMatch,
            NotLikeMatch,
            NotILikeMatch,
            BitwiseAnd,
            BitwiseOr,
            BitwiseXor,
            BitwiseShiftRight,
            BitwiseShiftLeft,
            StringConcat,
            AtArrow,
            ArrowAt,
            Arrow,
            LongArrow,
            HashArrow,
            HashLongArrow,
            AtAt,
            IntegerDivide,
        ];
        let mut judged = 0;
        for op in ops {
            for (l, r) in [("i", "j"), ("s", "u"), ("b", "c")] {
                let e = Expr::BinaryExpr(BinaryExpr::new(Box::new(col(l)), op, Box::new(col(r))));
                // Operators that do not apply to these types are not plans at all.
                let Ok(df) = ctx
                    .table("t")
                    .await
                    .unwrap()
                    .select(vec![e.clone().alias("x")])
                else {
                    continue;
                };
                let Ok(plan) = df.into_optimized_plan() else {
                    continue;
                };
                judged += 1;
                let state = ctx.state();
                let runs = match to_substrait_plan(&plan, &state) {
                    Ok(p) => {
                        validate(&p, "t", &node_evaluates).is_ok()
                            && from_substrait_plan(&state, &p).await.is_ok()
                    }
                    Err(_) => false,
                };
                assert_eq!(pushable(&e), runs, "{l} {op} {r}: pushable, node runs");
            }
        }
        assert!(judged > 40, "only {judged} operator/type pairs planned");
    }
}
