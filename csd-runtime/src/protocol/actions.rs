//! `DoAction` requests and their answers. Each request type names its action
//! ([`ActionRequest::TYPE`]) and its response type; bodies are JSON both ways, an empty
//! request body meaning `{}`. Any Flight client can call them:
//!
//! | action | request body | answer body |
//! |---|---|---|
//! | `stats` | `{}` | [`NodeStats`] |
//! | `delete` | `{"table": "t"}` or `{"table": "t", "partition": "p"}` | `{"deleted_objects": n}` |
//! | `objects` | `{"prefix": "t/"}` (optional) | a list of [`ObjectInfo`] |
//! | `put_module` | the bytes of a WebAssembly module (raw, not JSON) | [`PutModuleResponse`] |
//! | `refs` | `{}` | a list of [`RefDescription`]: the caller's kept results |
//! | `release` | `{"ticket": "<base64 of a kept result's ticket>"}` | its [`RefInfo`] |
//! | `grant` | `{"ticket": "<base64>", "tenant": "t", "revoke": false}` (`revoke` optional) | a [`RefDescription`]: the reference with a ticket for tenant `t` |
//! | `lease` | `{"slots": n, "seconds": t, "idle_seconds": i, "memory": "512MiB"}` (`idle_seconds`, `memory` optional) | [`LeaseInfo`] (or `RESOURCE_EXHAUSTED` with `retry-after-ms`) |
//! | `release_lease` | `{"lease": "<id>"}` | its [`LeaseInfo`] |
//! | `leases` | `{}` | a list of [`LeaseInfo`]: the caller's |
//! | `touch_lease` | `{"lease": "<id>"}` | its [`LeaseInfo`] (the holder is alive) |
//! | `invoke` | a JSON [`InvokeRequest`], a newline, an Arrow IPC stream of one batch (the arguments) | `{"start": "hot"\|"warm"}`, a newline, an Arrow IPC stream of one column `out` |
//! | `RenewFlightEndpoint` | protobuf `RenewFlightEndpointRequest` (Flight's) | protobuf `FlightEndpoint` |
//! | `CancelFlightInfo` | protobuf `CancelFlightInfoRequest` (Flight's) | protobuf `CancelFlightInfoResult` |

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::messages::NodeStats;
use crate::error::{Error, Result};
use crate::lease::LeaseInfo;
use crate::refs::RefInfo;
use crate::store::ObjectInfo;

/// A typed `DoAction` request.
pub trait ActionRequest: Serialize + DeserializeOwned {
    /// The action's name (`Action.type`).
    const TYPE: &'static str;
    /// What `ListActions` says of it.
    const DESCRIPTION: &'static str;
    /// The answer's body.
    type Response: Serialize + DeserializeOwned;

    /// The request as a Flight action.
    fn to_action(&self) -> Result<arrow_flight::Action> {
        let body = serde_json::to_vec(self).map_err(|e| Error::Internal(e.to_string()))?;
        Ok(arrow_flight::Action::new(Self::TYPE, body))
    }

    /// Decodes an action body (empty: `{}`).
    fn decode(body: &[u8]) -> Result<Self> {
        let body: &[u8] = if body.iter().all(u8::is_ascii_whitespace) {
            b"{}"
        } else {
            body
        };
        serde_json::from_slice(body).map_err(|e| {
            Error::InvalidArgument(format!(
                "the body of action {:?} is not the JSON it takes: {e}",
                Self::TYPE
            ))
        })
    }
}

/// `stats`: node, device, object-store, admission and request figures.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StatsRequest {}

impl ActionRequest for StatsRequest {
    const TYPE: &'static str = "stats";
    const DESCRIPTION: &'static str = "node, device, object-store and request figures as JSON";
    type Response = NodeStats;
}

/// `delete`: a table, or one partition of it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DeleteRequest {
    /// The table.
    pub table: String,
    /// Only this partition (`None`: the whole table).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<String>,
}

/// The answer to a [`DeleteRequest`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct DeleteResponse {
    /// Objects deleted.
    pub deleted_objects: u64,
}

impl ActionRequest for DeleteRequest {
    const TYPE: &'static str = "delete";
    const DESCRIPTION: &'static str =
        "delete a table or a partition; body {\"table\": ..., \"partition\": ...}";
    type Response = DeleteResponse;
}

/// `objects`: stored objects whose names start with a prefix.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ObjectsRequest {
    /// Name prefix (empty: all).
    #[serde(default)]
    pub prefix: String,
}

impl ActionRequest for ObjectsRequest {
    const TYPE: &'static str = "objects";
    const DESCRIPTION: &'static str = "list stored objects; body {\"prefix\": ...} (optional)";
    type Response = Vec<ObjectInfo>;
}

/// `put_module`: the action whose body is a WebAssembly module's bytes (not JSON).
/// The node checks the tenant's `code` permission and the module's size, compiles it
/// once (a module already there is not compiled again) and keeps it, named by its
/// SHA-256, for requests that name it. Answer: [`PutModuleResponse`].
pub const PUT_MODULE: &str = "put_module";

/// The answer to [`PUT_MODULE`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PutModuleResponse {
    /// `sha256:` and the 64 hex digits requests name it by.
    pub digest: String,
    /// Its size.
    pub bytes: u64,
    /// Whether this call compiled it (false: the node had it).
    pub compiled: bool,
}

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
        crate::refs::decode_ticket(&self.ticket)
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
        crate::refs::decode_ticket(&self.ticket)
    }
}

impl ActionRequest for GrantRequest {
    const TYPE: &'static str = "grant";
    const DESCRIPTION: &'static str = "let another tenant read a kept result; body {\"ticket\": \"<base64>\", \"tenant\": \"t\"} (\"revoke\": true takes it back)";
    type Response = RefDescription;
}

/// `lease`: CPU slots for a while, to invoke shipped functions on without queueing.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LeaseRequest {
    /// Slots.
    pub slots: usize,
    /// How long, in seconds.
    pub seconds: f64,
    /// End it earlier once its holder is silent (no invocation, no `touch_lease`)
    /// this many seconds: a client that disappears gives the slots back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_seconds: Option<f64>,
    /// Memory held for the operator requests run on it (`"512MiB"` or bytes);
    /// none: they draw on the node's free memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<crate::config::ByteSize>,
}

impl ActionRequest for LeaseRequest {
    const TYPE: &'static str = "lease";
    const DESCRIPTION: &'static str = "lease CPU slots to invoke shipped functions on; body {\"slots\": n, \"seconds\": t}; needs 'code'";
    type Response = LeaseInfo;
}

/// `release_lease`: ends a lease now.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ReleaseLeaseRequest {
    /// The lease's id.
    pub lease: String,
}

impl ActionRequest for ReleaseLeaseRequest {
    const TYPE: &'static str = "release_lease";
    const DESCRIPTION: &'static str = "end a lease now; body {\"lease\": \"<id>\"}";
    type Response = LeaseInfo;
}

/// `touch_lease`: the holder of a lease is alive (see [`LeaseRequest::idle_seconds`]).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TouchLeaseRequest {
    /// The lease's id.
    pub lease: String,
}

impl ActionRequest for TouchLeaseRequest {
    const TYPE: &'static str = "touch_lease";
    const DESCRIPTION: &'static str =
        "keep a lease with an idle limit alive; body {\"lease\": \"<id>\"}";
    type Response = LeaseInfo;
}

/// `leases`: the caller's leases.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LeasesRequest {}

impl ActionRequest for LeasesRequest {
    const TYPE: &'static str = "leases";
    const DESCRIPTION: &'static str = "list the caller's leases";
    type Response = Vec<LeaseInfo>;
}

/// The JSON head of an `invoke` body (see the module docs).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct InvokeRequest {
    /// The lease to run on.
    pub lease: String,
    /// The module: `sha256:` and 64 hex digits (sent before with `put_module`).
    pub module: String,
    /// The export to call (a SQL-function export of the guest SDK).
    pub export: String,
}

/// `invoke`: the action calling a function on a lease.
pub const INVOKE: &str = "invoke";

/// Every action a node serves, as `(type, description)` for `ListActions`.
pub(crate) const ACTIONS: [(&str, &str); 14] = [
    (StatsRequest::TYPE, StatsRequest::DESCRIPTION),
    (DeleteRequest::TYPE, DeleteRequest::DESCRIPTION),
    (ObjectsRequest::TYPE, ObjectsRequest::DESCRIPTION),
    (
        PUT_MODULE,
        "compile and keep a WebAssembly module (body: its bytes); needs 'code'",
    ),
    (RefsRequest::TYPE, RefsRequest::DESCRIPTION),
    (ReleaseRequest::TYPE, ReleaseRequest::DESCRIPTION),
    (GrantRequest::TYPE, GrantRequest::DESCRIPTION),
    (
        "RenewFlightEndpoint",
        "extend a kept result's expiration_time (Flight's RenewFlightEndpointRequest)",
    ),
    (
        "CancelFlightInfo",
        "free the kept results a FlightInfo names (Flight's CancelFlightInfoRequest)",
    ),
    (LeaseRequest::TYPE, LeaseRequest::DESCRIPTION),
    (ReleaseLeaseRequest::TYPE, ReleaseLeaseRequest::DESCRIPTION),
    (LeasesRequest::TYPE, LeasesRequest::DESCRIPTION),
    (TouchLeaseRequest::TYPE, TouchLeaseRequest::DESCRIPTION),
    (
        INVOKE,
        "call a shipped function on a lease; body: JSON {lease, module, export}, a newline, Arrow IPC arguments",
    ),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_round_trip_and_bad_ones_say_what_is_wrong() {
        let d = DeleteRequest {
            table: "t".into(),
            partition: Some("p".into()),
        };
        let a = d.to_action().unwrap();
        assert_eq!(a.r#type, "delete");
        assert_eq!(DeleteRequest::decode(&a.body).unwrap(), d);
        assert_eq!(StatsRequest::decode(b"").unwrap(), StatsRequest {});
        assert_eq!(ObjectsRequest::decode(b" ").unwrap().prefix, "");
        let e = DeleteRequest::decode(b"orders/2024")
            .unwrap_err()
            .to_string();
        assert!(e.contains("action \"delete\""), "{e}");
        let e = DeleteRequest::decode(br#"{"table":"t","partion":"p"}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("partion"), "{e}");
    }
}
