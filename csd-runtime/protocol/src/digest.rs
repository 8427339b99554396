//! Content digests: a shipped module's name ([`ModuleDigest`], the SHA-256 of its
//! bytes) and the hex form tokens and ids are written in.

use std::fmt;

use sha2::{Digest as _, Sha256};

use crate::text::truncated;

/// `b` as lowercase hex digits.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// 64 hex digits as 32 bytes (`None` if `s` is not that).
pub fn unhex32(s: &str) -> Option<[u8; 32]> {
    let s = s.trim();
    if s.len() != 64 || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// A module's name: the SHA-256 of its bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModuleDigest(pub [u8; 32]);

impl ModuleDigest {
    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        ModuleDigest(Sha256::digest(bytes).into())
    }

    /// Parses 64 hex digits (optionally prefixed `sha256:`), or 32 raw bytes.
    pub fn parse(s: &[u8]) -> Result<Self, BadDigest> {
        if let Ok(raw) = <[u8; 32]>::try_from(s) {
            return Ok(ModuleDigest(raw));
        }
        let s = std::str::from_utf8(s).unwrap_or("");
        unhex32(s.strip_prefix("sha256:").unwrap_or(s))
            .map(ModuleDigest)
            .ok_or_else(|| {
                BadDigest(format!(
                    "a module digest is 32 bytes or 64 hex digits, not {:?}",
                    truncated(s)
                ))
            })
    }

    /// The 64 hex digits.
    pub fn hex(&self) -> String {
        hex(&self.0)
    }

    /// The first 12 hex digits, for messages.
    pub fn short(&self) -> String {
        self.hex()[..12].to_string()
    }
}

impl fmt::Display for ModuleDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex())
    }
}

impl fmt::Debug for ModuleDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.short())
    }
}

/// A module digest that is not one (an `INVALID_ARGUMENT` as the node's error).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadDigest(String);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_parse_from_hex_raw_and_prefixed() {
        let d = ModuleDigest::of(b"abc");
        assert_eq!(ModuleDigest::parse(d.to_string().as_bytes()), Ok(d));
        assert_eq!(ModuleDigest::parse(d.hex().as_bytes()), Ok(d));
        assert_eq!(ModuleDigest::parse(&d.0), Ok(d));
        let e = ModuleDigest::parse(b"sha256:nothex").unwrap_err();
        assert!(e.to_string().contains("64 hex digits"), "{e}");
        assert_eq!(unhex32(&hex(&d.0)), Some(d.0));
    }
}
