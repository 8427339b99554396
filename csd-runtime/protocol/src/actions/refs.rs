//! The actions on kept results: `refs`, `release`, `grant` (and Flight's own
//! `RenewFlightEndpoint` and `CancelFlightInfo`, whose bodies are Flight's protobufs).

use serde::{Deserialize, Serialize};

use super::request::ActionRequest;
use crate::error::Result;
use crate::refs::{RefInfo, Reference, decode_ticket, rfc3339};

/// `refs`: the caller's kept results (all of them, for an admin).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RefsRequest {}

/// A kept result as `refs` lists it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RefDescription {
    /// What the node records of it.
    #[serde(flatten)]
    pub info: RefInfo,
    /// Its ticket, base64 (standard alphabet, padded): `DoGet` it.
    pub ticket: String,
    /// The node holding it.
    pub location: String,
}

impl RefDescription {
    /// The reference it describes.
    pub fn reference(&self) -> Reference {
        Reference {
            location: self.location.clone(),
            ticket: self.ticket.clone(),
            expires: rfc3339(self.info.expires_unix_ms),
            table: self.info.table.clone(),
        }
    }
}

impl ActionRequest for RefsRequest {
    const TYPE: &'static str = "refs";
    const DESCRIPTION: &'static str = "list the caller's kept results (references)";
    type Response = Vec<RefDescription>;
}

/// `release`: frees a kept result now.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequest {
    /// The kept result's ticket, base64.
    pub ticket: String,
}

impl ReleaseRequest {
    /// The ticket's bytes.
    pub fn ticket_bytes(&self) -> Result<Vec<u8>> {
        decode_ticket(&self.ticket)
    }
}

impl ActionRequest for ReleaseRequest {
    const TYPE: &'static str = "release";
    const DESCRIPTION: &'static str = "free a kept result now; body {\"ticket\": \"<base64>\"}";
    type Response = RefInfo;
}

/// `grant`: lets another tenant read a kept result (the whole kept query at this
/// node), or with `revoke`, no longer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GrantRequest {
    /// The kept result's ticket (the owner's), base64.
    pub ticket: String,
    /// The tenant to grant it to.
    pub tenant: String,
    /// Take the grant back instead.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub revoke: bool,
}

impl GrantRequest {
    /// The ticket's bytes.
    pub fn ticket_bytes(&self) -> Result<Vec<u8>> {
        decode_ticket(&self.ticket)
    }
}

impl ActionRequest for GrantRequest {
    const TYPE: &'static str = "grant";
    const DESCRIPTION: &'static str = "let another tenant read a kept result; body {\"ticket\": \"<base64>\", \"tenant\": \"t\"} (\"revoke\": true takes it back)";
    type Response = RefDescription;
}
