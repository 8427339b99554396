//! Which expressions the compute tier pushes to a node: those a node evaluates
//! exactly as the compute tier would ([`node_evaluates`]), and the Wasm SQL
//! functions a fragment ships the module of.

use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::logical_expr::{Expr, Volatility};
use datafusion_substrait::logical_plan::producer::operator_to_name;

use crate::compute::sandbox::is_wasm_function;
use crate::wire::functions::node_evaluates;

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
                    && (node_evaluates(f.func.name()) || is_wasm_function(&f.func))
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

/// True when `e` is a pushable aggregate: one of the fragment's aggregates (`sum`,
/// `count`, `min`, `max`, `avg`, the variances, …) of pushable arguments, without
/// DISTINCT, FILTER or ORDER BY.
pub(crate) fn pushable_aggregate(e: &Expr) -> bool {
    aggregate_of(e, crate::wire::fragment::AGGREGATES, false)
}

/// True when `e` (under aliases) is a call of one of the aggregates `names` over
/// pushable arguments, without FILTER or ORDER BY; over DISTINCT values only when
/// `distinct` allows it.
pub(crate) fn aggregate_of(e: &Expr, names: &[&str], distinct: bool) -> bool {
    match e {
        Expr::Alias(a) => aggregate_of(&a.expr, names, distinct),
        Expr::AggregateFunction(f) => {
            let p = &f.params;
            names.contains(&f.func.name())
                && (distinct || !p.distinct)
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
