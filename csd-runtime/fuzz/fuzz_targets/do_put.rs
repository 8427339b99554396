//! Any `DoPut` stream a client sends (messages framed by
//! `csd_runtime::protocol::ipc::frame`): decoding as the service does must give a
//! schema and batches or an INVALID_ARGUMENT error, never a panic.
#![no_main]

use csd_runtime::StatusCode;
use csd_runtime::protocol::ipc::{decode_put, unframe};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let messages = unframe(data);
    if let Err(e) = futures::executor::block_on(decode_put(messages)) {
        assert_eq!(e.status_code(), StatusCode::InvalidArgument, "{e}");
    }
});
