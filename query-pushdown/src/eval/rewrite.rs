//! The walk the fragment kernels' physical rules share: every filter's predicate,
//! rewritten by an expression rewrite over the filter's input schema.

use std::sync::Arc;

use arrow::datatypes::Schema;
use datafusion::common::Result;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::filter::{FilterExec, FilterExecBuilder};

/// An expression rewrite: `e` over `schema`, changed or not.
pub(crate) type ExprRewrite =
    fn(Arc<dyn PhysicalExpr>, &Schema) -> Result<Transformed<Arc<dyn PhysicalExpr>>>;

/// `p` with its predicate rewritten by `rewrite`, when `p` is a filter.
pub(crate) fn filter(
    p: Arc<dyn ExecutionPlan>,
    rewrite: ExprRewrite,
) -> Result<Transformed<Arc<dyn ExecutionPlan>>> {
    let Some(f) = p.downcast_ref::<FilterExec>() else {
        return Ok(Transformed::no(p));
    };
    let predicate = rewrite(f.predicate().clone(), &f.input().schema())?;
    if !predicate.transformed {
        return Ok(Transformed::no(p));
    }
    let f = FilterExecBuilder::from(f)
        .with_predicate(predicate.data)
        .build()?;
    Ok(Transformed::yes(Arc::new(f)))
}

/// `plan` with every filter's predicate rewritten by `rewrite`.
pub(crate) fn filters(
    plan: Arc<dyn ExecutionPlan>,
    rewrite: ExprRewrite,
) -> Result<Arc<dyn ExecutionPlan>> {
    plan.transform_up(|p| filter(p, rewrite)).map(|t| t.data)
}
