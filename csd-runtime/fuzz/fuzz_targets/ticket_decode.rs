//! Any bytes a client sends as a Flight ticket: decoding must return a ticket or an
//! error, never panic; a decoded ticket must re-encode to something that decodes to
//! the same ticket.
#![no_main]

use csd_runtime::protocol::Ticket;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Sealed or not: decoding never panics; a sealed one re-encodes to the same seal.
    if let Ok((_, Some(seal))) = Ticket::decode_sealed(data) {
        let again = csd_runtime::protocol::ticket::Seal::decode(&seal.encode())
            .expect("a re-encoded seal decodes");
        assert_eq!(again, seal);
    }
    if let Ok(t) = Ticket::decode(data) {
        let again = Ticket::decode(&t.encode()).expect("a re-encoded ticket decodes");
        assert_eq!(again, t);
        // The error path of the service turns decode errors into statuses: exercise it.
    } else if let Err(e) = Ticket::decode(data) {
        let _ = e.to_status();
    }
});
