//! The actions on leased slots: `lease`, `release_lease`, `touch_lease`, `leases`,
//! and `invoke` (a shipped function called on a lease).

use std::fmt;

use serde::{Deserialize, Serialize};

use super::request::ActionRequest;
use crate::error::{Error, Result};

/// The leases an operator request may run on (the `csd-lease` header: ids
/// comma-separated), the first one held here taking it; parsed once where the
/// request comes in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseIds(Vec<String>);

impl LeaseIds {
    /// Most ids one request may name.
    pub const MAX: usize = 64;

    /// Checks `ids` (each as [`crate::refs::new_group`] makes them; blanks
    /// skipped); `None` when none is left.
    pub fn new<S: AsRef<str>>(ids: impl IntoIterator<Item = S>) -> Result<Option<Self>> {
        let mut out = Vec::new();
        for id in ids {
            let id = id.as_ref().trim();
            if id.is_empty() {
                continue;
            }
            crate::refs::check_group(id).map_err(|_| {
                Error::InvalidArgument(format!(
                    "{}: {:?} is not a lease id (32 lowercase hex digits)",
                    crate::LEASE_METADATA,
                    crate::text::truncated(id)
                ))
            })?;
            if out.len() == Self::MAX {
                return Err(Error::InvalidArgument(format!(
                    "{}: more than {} lease ids",
                    crate::LEASE_METADATA,
                    Self::MAX
                )));
            }
            out.push(id.to_string());
        }
        Ok((!out.is_empty()).then_some(LeaseIds(out)))
    }

    /// The header's value, as [`LeaseIds::new`] checks it.
    pub fn parse(header: &str) -> Result<Option<Self>> {
        Self::new(header.split(','))
    }

    /// The ids, in the order given.
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(String::as_str)
    }
}

/// The header's value: the ids comma-separated.
impl fmt::Display for LeaseIds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join(","))
    }
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
    pub memory: Option<crate::size::ByteSize>,
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

/// A granted lease, as the node answers and lists it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LeaseInfo {
    /// 32 hex digits: the lease's name in invocations.
    pub id: String,
    /// The tenant holding it.
    pub tenant: String,
    /// CPU slots reserved for it.
    pub slots: usize,
    /// When it ends, milliseconds since the Unix epoch.
    pub expires_unix_ms: u64,
    /// It ends earlier when its holder is silent this long (ms); `None`: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_ms: Option<u64>,
    /// Memory held for the requests run on it, bytes (0: none of its own; they draw
    /// on the node's free memory).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub memory: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// How an invocation started.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Start {
    /// On an instance the lease kept.
    Hot,
    /// On a new instance of a compiled module.
    Warm,
    /// The node lacked the module: the client sent its bytes, then called (a client's
    /// word; a node answers `hot` or `warm`).
    Cold,
}

impl std::fmt::Display for Start {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Start::Hot => "hot",
            Start::Warm => "warm",
            Start::Cold => "cold",
        })
    }
}

/// The JSON head of an `invoke` answer (a newline and the result's Arrow IPC follow).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct InvokeAnswer {
    /// How the call started.
    pub start: Start,
}
