//! Any bytes a client sends as the arguments of a `wasm` operator ticket: decoding
//! (digest, arguments, the input fragment) accepts or refuses with `InvalidArgument`,
//! never panics.
#![no_main]

use csd_query_pushdown::wire::fragment::NodeError;
use csd_query_pushdown::wire::wasm::WasmRequest;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = WasmRequest::decode_checked(data) {
        assert!(matches!(e, NodeError::InvalidArgument(_)), "{e}");
    }
});
