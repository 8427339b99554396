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
pub fn node_evaluates(name: &str) -> bool {
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
/// literals, the operators and functions of [`node_evaluates`], casts, CASE, IN
/// lists. (Whether the encoded fragment as a whole fits the node's limits is
/// checked on the fragment: [`crate::wire::fragment::check`].)
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
                    && node_evaluates(f.func.name())
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
pub fn pushable_aggregate(e: &Expr) -> bool {
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
