//! Any bytes a client sends as the arguments of a `sql` operator ticket: decoding and
//! validation (join-key filters included) must accept or refuse with
//! `InvalidArgument`, never panic, never overflow the stack, whatever the nesting.
#![no_main]

use arrow::datatypes::DataType;
use csd_query_pushdown::wire::fragment::{NodeError, SqlFragment, validate};
use csd_query_pushdown::wire::keyfilter::KeyFilter;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let allowed = |f: &str| {
        matches!(f, "equal" | "lt" | "gt" | "and" | "or" | "not" | "add" | "multiply" | "like" | "upper")
    };
    let checked = SqlFragment::decode_checked(data).and_then(|checked| {
        let frag = &checked.frag;
        validate(&checked.plan, &frag.table, &allowed)?;
        // As the node checks filters against the plan's output: two columns here.
        let output = [DataType::Int64, DataType::Utf8];
        for f in &frag.key_filters {
            KeyFilter::from_msg(f, &output).map_err(NodeError::from)?;
        }
        Ok(())
    });
    if let Err(e) = checked {
        // Malformed: INVALID_ARGUMENT; a function the node does not run: UNIMPLEMENTED
        // (the compute tier then evaluates the fragment itself).
        assert!(
            matches!(e, NodeError::InvalidArgument(_) | NodeError::Unimplemented(_)),
            "{e}"
        );
    }
});
