//! Which expressions a storage node evaluates exactly as the compute tier would.
//!
//! The node runs the same DataFusion, so every built-in, non-volatile scalar function
//! gives the same answer there. Not pushable: volatile functions (`random()`), user
//! functions the node does not have, subqueries, aggregates and windows (aggregates
//! are pushed separately, as partial aggregates), placeholders and outer references.

use std::sync::OnceLock;

use datafusion::execution::{FunctionRegistry, SessionState, SessionStateBuilder};
use datafusion::logical_expr::Volatility;
use datafusion_substrait::logical_plan::consumer::{name_to_op, substrait_to_df_name};

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
