//! `AND` and `OR` chains as one n-ary Substrait call.
//!
//! DataFusion's Substrait producer writes `a AND b AND c …` as nested binary calls,
//! so a filter of 32 conditions nests ~100 protobuf messages deep: past the decoder's
//! recursion limit at the node, and past its expression depth limit well before. The
//! two connectives are variadic in Substrait, and DataFusion's consumer rebuilds an
//! n-ary call as a balanced tree. So the compute tier flattens the chains before it
//! sends a plan: a filter of any number of conditions nests a few levels deep.

use std::collections::HashSet;

use datafusion_substrait::substrait::proto::{
    Expression, FunctionArgument, Plan, Rel, expression::RexType,
    extensions::simple_extension_declaration::MappingType, function_argument::ArgType, plan_rel,
    rel::RelType,
};

/// Flattens every `and`/`or` chain of `plan` into one call per chain.
pub(crate) fn flatten_connectives(plan: &mut Plan) {
    let anchors: HashSet<u32> = plan
        .extensions
        .iter()
        .filter_map(|e| match &e.mapping_type {
            Some(MappingType::ExtensionFunction(f)) => {
                let base = f.name.split(':').next().unwrap_or_default();
                (base.eq_ignore_ascii_case("and") || base.eq_ignore_ascii_case("or"))
                    .then_some(f.function_anchor)
            }
            _ => None,
        })
        .collect();
    if anchors.is_empty() {
        return;
    }
    for rel in &mut plan.relations {
        let root = match rel.rel_type.as_mut() {
            Some(plan_rel::RelType::Root(r)) => r.input.as_mut(),
            Some(plan_rel::RelType::Rel(r)) => Some(r),
            None => None,
        };
        if let Some(root) = root {
            rel_exprs(root, &mut |e| flatten(e, &anchors));
        }
    }
}

/// Calls `f` on every expression of `rel` and its inputs (the relations a fragment
/// holds: read, filter, project, aggregate, sort, fetch).
fn rel_exprs(rel: &mut Rel, f: &mut dyn FnMut(&mut Expression)) {
    let input = match rel.rel_type.as_mut() {
        Some(RelType::Read(r)) => {
            if let Some(e) = &mut r.filter {
                f(e);
            }
            if let Some(e) = &mut r.best_effort_filter {
                f(e);
            }
            None
        }
        Some(RelType::Filter(r)) => {
            if let Some(e) = &mut r.condition {
                f(e);
            }
            r.input.as_mut()
        }
        Some(RelType::Project(r)) => {
            r.expressions.iter_mut().for_each(&mut *f);
            r.input.as_mut()
        }
        Some(RelType::Aggregate(r)) => {
            r.grouping_expressions.iter_mut().for_each(&mut *f);
            // Older producers wrote expressions into each grouping.
            #[allow(deprecated)]
            for g in &mut r.groupings {
                g.grouping_expressions.iter_mut().for_each(&mut *f);
            }
            for m in &mut r.measures {
                m.filter.iter_mut().for_each(&mut *f);
                if let Some(a) = &mut m.measure {
                    args(&mut a.arguments, f);
                }
            }
            r.input.as_mut()
        }
        Some(RelType::Sort(r)) => {
            r.sorts
                .iter_mut()
                .flat_map(|s| s.expr.as_mut())
                .for_each(&mut *f);
            r.input.as_mut()
        }
        Some(RelType::Fetch(r)) => r.input.as_mut(),
        _ => None,
    };
    if let Some(input) = input {
        rel_exprs(input, f);
    }
}

fn args(arguments: &mut [FunctionArgument], f: &mut dyn FnMut(&mut Expression)) {
    for a in arguments {
        if let Some(ArgType::Value(e)) = &mut a.arg_type {
            f(e);
        }
    }
}

/// Flattens the chains in `e`, inner ones first.
fn flatten(e: &mut Expression, anchors: &HashSet<u32>) {
    match e.rex_type.as_mut() {
        Some(RexType::ScalarFunction(call)) => {
            args(&mut call.arguments, &mut |a| flatten(a, anchors));
            if !anchors.contains(&call.function_reference) {
                return;
            }
            let reference = call.function_reference;
            let mut flat = Vec::with_capacity(call.arguments.len());
            for a in std::mem::take(&mut call.arguments) {
                match a.arg_type {
                    Some(ArgType::Value(Expression {
                        rex_type: Some(RexType::ScalarFunction(inner)),
                    })) if inner.function_reference == reference && inner.options.is_empty() => {
                        flat.extend(inner.arguments)
                    }
                    arg_type => flat.push(FunctionArgument { arg_type }),
                }
            }
            call.arguments = flat;
        }
        Some(RexType::IfThen(i)) => {
            for c in &mut i.ifs {
                for x in [&mut c.r#if, &mut c.then].into_iter().flatten() {
                    flatten(x, anchors);
                }
            }
            if let Some(x) = &mut i.r#else {
                flatten(x, anchors);
            }
        }
        Some(RexType::Cast(c)) => {
            if let Some(x) = &mut c.input {
                flatten(x, anchors);
            }
        }
        _ => {}
    }
}
