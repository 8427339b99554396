//! Who is asking. The gateway keeps no tenants of its own: it asks the nodes with
//! the caller's bearer token, so the nodes' tenants file decides what the caller may
//! read, its quotas and its admission share — exactly as if the caller had asked
//! them itself. A Flight `Handshake` with Basic credentials (`tenant:token`, with or
//! without base64 padding) answers the token as the bearer to send from then on,
//! once the nodes have accepted it.

use csd_protocol::credential::{Credential, parse_authorization};
use csd_protocol::{AUTHORIZATION, Error};
use sha2::{Digest, Sha256};
use tonic::metadata::MetadataMap;

/// A caller: the token it sent (none: the nodes must admit anyone).
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Caller {
    pub(crate) token: Option<String>,
}

impl std::fmt::Debug for Caller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Caller")
            .field("token", &self.token.as_ref().map(|_| "…"))
            .finish()
    }
}

impl Caller {
    /// The caller of a request: `authorization: Bearer <token>` (or Basic, whose
    /// password is the token).
    pub(crate) fn of(metadata: &MetadataMap) -> Result<Self, Error> {
        let token = match metadata.get(AUTHORIZATION) {
            None => None,
            Some(v) => Some(match parse_authorization(v.as_bytes())? {
                Credential::Bearer(t) => t,
                Credential::Basic { password, .. } => password,
            }),
        };
        Ok(Caller { token })
    }

    /// A digest naming the caller in counters (never the token itself).
    pub(crate) fn digest(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        if let Some(t) = &self.token {
            h.update(b"token:");
            h.update(t.as_bytes());
        }
        h.finalize().into()
    }

    /// The `authorization` value a handshake answers: the bearer to send from now on.
    pub(crate) fn bearer(&self) -> Option<String> {
        self.token.as_ref().map(|t| format!("Bearer {t}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(value: &str) -> MetadataMap {
        let mut m = MetadataMap::new();
        m.insert(AUTHORIZATION, value.parse().unwrap());
        m
    }

    #[test]
    fn bearer_basic_padded_or_not_and_none() {
        use base64::Engine;
        assert_eq!(Caller::of(&MetadataMap::new()).unwrap().token, None);
        assert_eq!(
            Caller::of(&with("Bearer abc")).unwrap().token.as_deref(),
            Some("abc")
        );
        // "alice:s3cret1" is 13 bytes: padded and unpadded base64 differ.
        let raw = b"alice:s3cret1";
        let padded = base64::engine::general_purpose::STANDARD.encode(raw);
        let bare = base64::engine::general_purpose::STANDARD_NO_PAD.encode(raw);
        assert_ne!(padded, bare);
        for b in [padded, bare] {
            let c = Caller::of(&with(&format!("Basic {b}"))).unwrap();
            assert_eq!(c.token.as_deref(), Some("s3cret1"));
            assert_eq!(c.bearer().as_deref(), Some("Bearer s3cret1"));
        }
        let e = Caller::of(&with("Token x")).unwrap_err();
        assert_eq!(e.status_code(), csd_protocol::StatusCode::Unauthenticated);
        assert_ne!(
            Caller::of(&with("Bearer a")).unwrap().digest(),
            Caller::of(&with("Bearer b")).unwrap().digest()
        );
    }
}
