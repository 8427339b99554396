//! Which expressions a storage node evaluates exactly as the compute tier would.
//!
//! The node runs the same DataFusion, so every built-in, non-volatile scalar function
//! gives the same answer there. Not pushable: volatile functions (`random()`), user
//! functions the node does not have, subqueries, aggregates and windows (aggregates
//! are pushed separately, as partial aggregates), placeholders and outer references.

use std::collections::HashSet;
use std::sync::OnceLock;

use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::execution::SessionStateBuilder;
use datafusion::logical_expr::{Expr, Volatility};

fn builtin_functions() -> &'static HashSet<String> {
    static NAMES: OnceLock<HashSet<String>> = OnceLock::new();
    NAMES.get_or_init(|| {
        SessionStateBuilder::new()
            .with_default_features()
            .build()
            .scalar_functions()
            .iter()
            .filter(|(_, f)| f.signature().volatility != Volatility::Volatile)
            .map(|(n, _)| n.clone())
            .collect()
    })
}

/// True when the node can evaluate `e` exactly.
pub fn pushable(e: &Expr) -> bool {
    let mut ok = true;
    let _ = e.apply(|x| {
        let fine = match x {
            Expr::Column(_)
            | Expr::Literal(..)
            | Expr::Alias(_)
            | Expr::BinaryExpr(_)
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
            Expr::ScalarFunction(f) => {
                f.func.signature().volatility != Volatility::Volatile
                    && builtin_functions().contains(f.func.name())
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
            crate::fragment::AGGREGATES.contains(&f.func.name())
                && !p.distinct
                && p.filter.is_none()
                && p.order_by.is_empty()
                && p.args.iter().all(pushable)
        }
        _ => false,
    }
}
