//! Any bytes a client sends as `authorization` metadata (and any text as a tenants
//! file): parsing returns credentials or an UNAUTHENTICATED / INVALID_ARGUMENT error,
//! never a panic; a principal is only ever the tenant whose token was sent.
#![no_main]

use std::sync::LazyLock;

use csd_runtime::StatusCode;
use csd_runtime::auth::{Auth, Credential, parse_authorization, parse_tenants, token_digest};
use libfuzzer_sys::fuzz_target;

static AUTH: LazyLock<Auth> = LazyLock::new(|| {
    Auth::from_text(&format!(
        "[[tenant]]\nname = \"etl\"\ntoken_sha256 = \"{}\"\ntables = [\"*\"]\ncan = [\"read\"]\n",
        token_digest("etl-token")
    ))
    .expect("the fuzz tenants parse")
});

fuzz_target!(|data: &[u8]| {
    match parse_authorization(data) {
        Ok(Credential::Bearer(t)) => assert!(!t.is_empty() && !t.contains(' ')),
        Ok(Credential::Basic { user, .. }) => assert!(!user.is_empty()),
        Err(e) => {
            assert_eq!(e.status_code(), StatusCode::Unauthenticated);
            let _ = e.to_status();
        }
    }
    match AUTH.principal(Some(data), None, "claimed") {
        Ok(p) => {
            assert_eq!(p.name(), "etl");
            let token = match parse_authorization(data).expect("accepted, so it parses") {
                Credential::Bearer(t) => t,
                Credential::Basic { password, .. } => password,
            };
            assert_eq!(token, "etl-token");
        }
        Err(e) => assert_eq!(e.status_code(), StatusCode::Unauthenticated),
    }
    if let Ok(text) = std::str::from_utf8(data)
        && let Err(e) = parse_tenants(text, "fuzz")
    {
        assert_eq!(e.status_code(), StatusCode::InvalidArgument);
    }
});
