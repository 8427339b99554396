//! `DoAction` requests and their answers. Each request type names its action
//! ([`ActionRequest::TYPE`]) and its response type; bodies are JSON both ways, an empty
//! request body meaning `{}`. Any Flight client can call them:
//!
//! | action | request body | answer body |
//! |---|---|---|
//! | `stats` | `{}` | [`NodeStats`] |
//! | `delete` | `{"table": "t"}` or `{"table": "t", "partition": "p"}` | `{"deleted_objects": n}` |
//! | `objects` | `{"prefix": "t/"}` (optional) | a list of [`ObjectEntry`] |
//! | `put_module` | the bytes of a WebAssembly module (raw, not JSON) | [`PutModuleResponse`] |
//! | `refs` | `{}` | a list of [`RefDescription`]: the caller's kept results |
//! | `release` | `{"ticket": "<base64 of a kept result's ticket>"}` | its [`RefInfo`] |
//! | `grant` | `{"ticket": "<base64>", "tenant": "t", "revoke": false}` (`revoke` optional) | a [`RefDescription`]: the reference with a ticket for tenant `t` |
//! | `lease` | `{"slots": n, "seconds": t, "idle_seconds": i, "memory": "512MiB"}` (`idle_seconds`, `memory` optional) | [`LeaseInfo`] (or `RESOURCE_EXHAUSTED` with `retry-after-ms`) |
//! | `release_lease` | `{"lease": "<id>"}` | its [`LeaseInfo`] |
//! | `leases` | `{}` | a list of [`LeaseInfo`]: the caller's |
//! | `touch_lease` | `{"lease": "<id>"}` | its [`LeaseInfo`] (the holder is alive) |
//! | `invoke` | a JSON [`InvokeRequest`], a newline, an Arrow IPC stream of one batch (the arguments) | an [`InvokeAnswer`] (`{"start": "hot"\|"warm"}`), a newline, an Arrow IPC stream of one column `out` |
//! | `RenewFlightEndpoint` | protobuf `RenewFlightEndpointRequest` (Flight's) | protobuf `FlightEndpoint` |
//! | `CancelFlightInfo` | protobuf `CancelFlightInfoRequest` (Flight's) | protobuf `CancelFlightInfoResult` |

use serde::{Deserialize, Serialize};

mod leases;
mod refs;
mod request;

pub use leases::{
    InvokeAnswer, InvokeRequest, LeaseIds, LeaseInfo, LeaseRequest, LeasesRequest,
    ReleaseLeaseRequest, Start, TouchLeaseRequest,
};
pub use refs::{GrantRequest, RefDescription, RefsRequest, ReleaseRequest};
pub use request::ActionRequest;

use crate::messages::ObjectEntry;
use crate::stats::NodeStats;

/// `stats`: node, device, object-store, admission and request figures.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StatsRequest {}

impl ActionRequest for StatsRequest {
    const TYPE: &'static str = "stats";
    const DESCRIPTION: &'static str = "node, device, object-store and request figures as JSON";
    type Response = NodeStats;
}

/// `scrub`: read every stored object's chunks from the device and check them.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ScrubRequest {
    /// Only objects whose names start with this (all when empty).
    #[serde(default)]
    pub prefix: String,
}

impl ActionRequest for ScrubRequest {
    const TYPE: &'static str = "scrub";
    const DESCRIPTION: &'static str =
        "read every stored object's chunks from the device and check their checksums (admins only)";
    type Response = crate::stats::ScrubReport;
}

/// `gateway_stats`: a Flight SQL gateway's figures (served by `csd gateway`, not
/// by nodes).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GatewayStatsRequest {}

impl ActionRequest for GatewayStatsRequest {
    const TYPE: &'static str = "gateway_stats";
    const DESCRIPTION: &'static str = "a Flight SQL gateway's figures as JSON";
    type Response = crate::stats::GatewayStats;
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
    /// Deletes to remember first, whether or not this node holds the copies they
    /// name: a node out of reach now may hold one, and it must stay deleted when
    /// that node comes back (see [`crate::messages::DeletedCopy`]). With these,
    /// holding nothing to delete here is not an error.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remember: Vec<crate::messages::DeletedCopy>,
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
    type Response = Vec<ObjectEntry>;
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

/// `put_attachment`: the action whose body is bytes several requests of one job
/// share (a join's key filter, sent once to a node instead of with each of its
/// fragments). The node keeps them, named by their SHA-256, within its memory
/// budget for a while after their last use ([`PutAttachmentResponse::kept_secs`]);
/// a request naming one the node no longer keeps gets `NOT_FOUND` with the digest
/// in `csd-missing-attachment` metadata. Any authenticated principal may send one.
pub const PUT_ATTACHMENT: &str = "put_attachment";

/// The answer to [`PUT_ATTACHMENT`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PutAttachmentResponse {
    /// `sha256:` and the 64 hex digits requests name it by.
    pub digest: String,
    /// Its size.
    pub bytes: u64,
    /// How long the node keeps it after its last use, in seconds.
    pub kept_secs: u64,
}

/// `invoke`: the action calling a function on a lease.
pub const INVOKE: &str = "invoke";

/// `RenewFlightEndpoint`: Flight's action extending a kept result's expiry (body and
/// answer: protobuf `RenewFlightEndpointRequest` / `FlightEndpoint`).
pub const RENEW_FLIGHT_ENDPOINT: &str = "RenewFlightEndpoint";
/// `CancelFlightInfo`: Flight's action freeing the kept results a `FlightInfo` names
/// (protobuf `CancelFlightInfoRequest` / `CancelFlightInfoResult`).
pub const CANCEL_FLIGHT_INFO: &str = "CancelFlightInfo";

/// Every action a node serves, as `(type, description)` for `ListActions`.
pub const ACTIONS: [(&str, &str); 16] = [
    (StatsRequest::TYPE, StatsRequest::DESCRIPTION),
    (ScrubRequest::TYPE, ScrubRequest::DESCRIPTION),
    (DeleteRequest::TYPE, DeleteRequest::DESCRIPTION),
    (ObjectsRequest::TYPE, ObjectsRequest::DESCRIPTION),
    (
        PUT_MODULE,
        "compile and keep a WebAssembly module (body: its bytes); needs 'code'",
    ),
    (
        PUT_ATTACHMENT,
        "keep bytes several requests share, named by their SHA-256 (body: the bytes)",
    ),
    (RefsRequest::TYPE, RefsRequest::DESCRIPTION),
    (ReleaseRequest::TYPE, ReleaseRequest::DESCRIPTION),
    (GrantRequest::TYPE, GrantRequest::DESCRIPTION),
    (
        RENEW_FLIGHT_ENDPOINT,
        "extend a kept result's expiration_time (Flight's RenewFlightEndpointRequest)",
    ),
    (
        CANCEL_FLIGHT_INFO,
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
            remember: vec![crate::messages::DeletedCopy {
                partition: "p".into(),
                digests: vec![7, 9],
            }],
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
