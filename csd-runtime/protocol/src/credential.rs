//! The `authorization` metadata a request carries: a bearer token, or Basic
//! credentials for Flight's handshake ([`parse_authorization`], fuzzed).

use crate::error::{Error, Result};

/// Longest token accepted.
pub const MAX_TOKEN_BYTES: usize = 4096;

/// Credentials a request carries in its `authorization` metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Credential {
    /// `Bearer <token>`.
    Bearer(String),
    /// `Basic base64(user:password)` (Flight's `Handshake` with basic auth).
    Basic {
        /// The tenant name.
        user: String,
        /// Its token.
        password: String,
    },
}

/// Parses an `authorization` value. Never panics on any bytes.
pub fn parse_authorization(value: &[u8]) -> Result<Credential> {
    let malformed = || {
        Error::Unauthenticated(
            "the authorization metadata must be 'Bearer <token>' (or 'Basic <base64 of tenant:token>' for a Flight handshake)".into(),
        )
    };
    if value.len() > MAX_TOKEN_BYTES + 16 {
        return Err(Error::Unauthenticated(format!(
            "the authorization metadata is longer than {MAX_TOKEN_BYTES} bytes"
        )));
    }
    let text = std::str::from_utf8(value).map_err(|_| malformed())?.trim();
    let (scheme, rest) = text.split_once(' ').ok_or_else(malformed)?;
    let rest = rest.trim();
    let visible = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_graphic());
    if scheme.eq_ignore_ascii_case("bearer") {
        if !visible(rest) {
            return Err(malformed());
        }
        return Ok(Credential::Bearer(rest.to_string()));
    }
    if scheme.eq_ignore_ascii_case("basic") {
        use base64::Engine;
        use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
        // With or without `=` padding: Go's Flight SQL client (under ADBC) sends
        // none.
        const BASIC: GeneralPurpose = GeneralPurpose::new(
            &base64::alphabet::STANDARD,
            GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
        );
        let raw = BASIC.decode(rest).map_err(|_| malformed())?;
        let raw = String::from_utf8(raw).map_err(|_| malformed())?;
        let (user, password) = raw.split_once(':').ok_or_else(malformed)?;
        if user.is_empty() || !visible(password) {
            return Err(malformed());
        }
        return Ok(Credential::Basic {
            user: user.to_string(),
            password: password.to_string(),
        });
    }
    Err(malformed())
}
