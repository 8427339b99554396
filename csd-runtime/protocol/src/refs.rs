//! Kept results as the protocol names them: what a node records of one
//! ([`RefInfo`]), what a client holds and prints ([`Reference`]: location, base64
//! ticket, RFC 3339 expiry), and the time and id helpers both sides use. How a node
//! keeps them is the node's business (`csd_runtime::refs`).

use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::digest::hex;
use crate::error::{Error, Result, truncated};

/// A new group (or id): 32 random hex digits.
pub fn new_group() -> String {
    hex(&rand::random::<[u8; 16]>())
}

/// `Ok` if `g` is a group or id as [`new_group`] makes them.
pub fn check_group(g: &str) -> Result<()> {
    if g.len() == 32
        && g.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "a kept result's group must be 32 lowercase hex digits, not {:?}",
            truncated(g)
        )))
    }
}
/// A kept result: what the node records of it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RefInfo {
    /// 32 hex digits, random: unguessable.
    pub id: String,
    /// The tenant that kept it (empty on a node without tenants).
    pub tenant: String,
    /// The operator that made it (`sql`, `wasm`, …).
    pub operator: String,
    /// The table it is a partition of (`csd_ref_GROUP`; the partition is `id`).
    pub table: String,
    /// Milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// When the node frees it, milliseconds since the Unix epoch.
    pub expires_unix_ms: u64,
    /// Rows in it.
    pub rows: u64,
    /// Bytes it takes on the device.
    pub bytes: u64,
    /// Other tenants it was granted to: they may read it, not renew or free it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub readers: Vec<String>,
}

impl RefInfo {
    /// Whether it has expired at `now_ms`.
    pub fn expired_at(&self, now_ms: u64) -> bool {
        now_ms >= self.expires_unix_ms
    }

    /// Whether `tenant` may read it: its owner or a grantee.
    pub fn readable_by(&self, tenant: &str) -> bool {
        self.tenant == tenant || self.readers.iter().any(|r| r == tenant)
    }
}

/// `unix_ms` (milliseconds since the Unix epoch) as a protobuf timestamp.
pub fn timestamp(unix_ms: u64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: (unix_ms / 1000) as i64,
        nanos: ((unix_ms % 1000) * 1_000_000) as i32,
    }
}

/// A ticket as references and actions carry it: base64 (standard alphabet).
pub fn decode_ticket(base64_ticket: &str) -> Result<Vec<u8>> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD
        .decode(base64_ticket.trim())
        .map_err(|e| Error::InvalidArgument(format!("the reference's ticket is not base64: {e}")))
}

/// `unix_ms` as RFC 3339 (UTC, milliseconds).
pub fn rfc3339(unix_ms: u64) -> String {
    chrono::DateTime::from_timestamp_millis(unix_ms.min(i64::MAX as u64) as i64)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// Milliseconds since the Unix epoch, now.
pub fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
/// A kept result as a client holds it and prints it (one JSON object per endpoint):
/// `{"location": "grpc://host:port", "ticket": "<base64>", "expires": "<RFC 3339>"}`.
/// Any Flight client resolves it with a plain `DoGet` of the ticket at the location.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Reference {
    /// The node holding it.
    pub location: String,
    /// Its Flight ticket, base64 (standard alphabet, padded).
    pub ticket: String,
    /// When the node frees it (RFC 3339, UTC).
    pub expires: String,
    /// The table it is a partition of (`csd_ref_GROUP`): the next query's input.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub table: String,
}

impl Reference {
    /// From a kept result's endpoint; `default_location` when it names none.
    pub fn of_endpoint(e: &arrow_flight::FlightEndpoint, default_location: &str) -> Result<Self> {
        use base64::Engine as _;
        let ticket = e
            .ticket
            .as_ref()
            .ok_or_else(|| Error::Internal("a kept result's endpoint has no ticket".into()))?;
        let expires = e
            .expiration_time
            .as_ref()
            .map(|t| rfc3339(t.seconds.max(0) as u64 * 1000 + t.nanos.max(0) as u64 / 1_000_000))
            .unwrap_or_default();
        Ok(Reference {
            location: e
                .location
                .first()
                .map(|l| l.uri.clone())
                .unwrap_or_else(|| default_location.to_string()),
            ticket: base64::engine::general_purpose::STANDARD.encode(&ticket.ticket),
            expires,
            table: String::from_utf8(e.app_metadata.to_vec()).unwrap_or_default(),
        })
    }

    /// Parses one reference as printed (JSON); a bad one is `INVALID_ARGUMENT` saying
    /// what a reference looks like.
    pub fn parse(text: &str) -> Result<Self> {
        serde_json::from_str(text.trim()).map_err(|e| {
            Error::InvalidArgument(format!(
                "not a reference ({e}): expected {{\"location\": \"grpc://host:port\", \"ticket\": \"<base64>\", \"expires\": \"<RFC 3339>\"}}"
            ))
        })
    }

    /// The ticket's bytes.
    pub fn ticket_bytes(&self) -> Result<Vec<u8>> {
        decode_ticket(&self.ticket)
    }

    /// When it expires, milliseconds since the Unix epoch (0 when not given).
    pub fn expires_unix_ms(&self) -> u64 {
        chrono::DateTime::parse_from_rfc3339(&self.expires)
            .map(|t| t.timestamp_millis().max(0) as u64)
            .unwrap_or(0)
    }

    /// As a Flight endpoint (to renew or cancel it with any Flight client).
    pub fn endpoint(&self) -> Result<arrow_flight::FlightEndpoint> {
        let ms = self.expires_unix_ms();
        let mut e = arrow_flight::FlightEndpoint::new()
            .with_ticket(arrow_flight::Ticket::new(self.ticket_bytes()?))
            .with_location(self.location.clone());
        if ms > 0 {
            e = e.with_expiration_time(timestamp(ms));
        }
        Ok(e)
    }
}
