//! Any `DoPut` stream a client sends (messages framed by
//! `csd_runtime::protocol::ipc::frame`), decoded by the service's own decoder
//! (`PutDecoder`, which `DoPut` stores from): a schema and batches, or an
//! INVALID_ARGUMENT error. Arrow's IPC schema conversion panics on some malformed
//! fields; the decoder catches that panic and refuses the put, so here a caught panic
//! is the behaviour under test (the hook is quietened) and only one that escapes is a
//! crash.
#![no_main]

use csd_runtime::StatusCode;
use csd_runtime::protocol::ipc::{PutDecoder, unframe};
use libfuzzer_sys::fuzz_target;

fuzz_target!(
    init: {
        std::panic::set_hook(Box::new(|_| {}));
    },
    |data: &[u8]| {
        let messages = unframe(data).into_iter().map(Ok);
        let mut decoder = PutDecoder::new(futures::stream::iter(messages));
        let decoded = futures::executor::block_on(async {
            decoder.schema().await?;
            while let Some(b) = decoder.next_batch().await {
                b?;
            }
            Ok::<_, csd_runtime::Error>(())
        });
        if let Err(e) = decoded {
            assert_eq!(e.status_code(), StatusCode::InvalidArgument, "{e}");
        }
    }
);
