//! Any `DoPut` stream a client sends (messages framed by
//! `csd_runtime::protocol::ipc::frame`): decoding as the service does must give a
//! schema and batches or an INVALID_ARGUMENT error. Arrow's IPC schema conversion
//! panics on some malformed fields; the service catches that panic and refuses the
//! put, so here a caught panic is the behaviour under test (the hook is quietened)
//! and only one that escapes is a crash.
#![no_main]

use csd_runtime::StatusCode;
use csd_runtime::protocol::ipc::{decode_put, unframe};
use libfuzzer_sys::fuzz_target;

fuzz_target!(
    init: {
        std::panic::set_hook(Box::new(|_| {}));
    },
    |data: &[u8]| {
        let messages = unframe(data);
        if let Err(e) = futures::executor::block_on(decode_put(messages)) {
            assert_eq!(e.status_code(), StatusCode::InvalidArgument, "{e}");
        }
    }
);
