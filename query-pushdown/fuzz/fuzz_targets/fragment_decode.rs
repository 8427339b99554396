//! Any bytes a client sends as the arguments of a `sql` operator ticket: decoding and
//! validation must accept or refuse with `InvalidArgument`, never panic, never
//! overflow the stack, whatever the nesting.
#![no_main]

use csd_query_pushdown::fragment::{NodeError, SqlFragment, validate};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let allowed = |f: &str| {
        matches!(f, "equal" | "lt" | "gt" | "and" | "or" | "not" | "add" | "multiply" | "like" | "upper")
    };
    let checked = SqlFragment::decode_checked(data)
        .and_then(|(frag, _mode, plan)| validate(&plan, &frag.table, &allowed));
    if let Err(e) = checked {
        assert!(matches!(e, NodeError::InvalidArgument(_)), "{e}");
    }
});
