//! What a tenant may do ([`Permission`]), and the refusals counted for the metrics.

use std::sync::atomic::AtomicU64;

use serde::Deserialize;

/// What a tenant may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Permission {
    /// List, describe, scan, run operators over, and range-read a table.
    Read,
    /// Store objects in a table.
    Write,
    /// Delete a table or its partitions.
    Delete,
    /// Ship code to run at the node.
    Code,
    /// Node figures, the object list, raw ranges of any table's objects.
    Admin,
}

impl Permission {
    /// Its name in the tenants file.
    pub fn as_str(self) -> &'static str {
        match self {
            Permission::Read => "read",
            Permission::Write => "write",
            Permission::Delete => "delete",
            Permission::Code => "code",
            Permission::Admin => "admin",
        }
    }
}

/// Refusals counted for the metrics.
#[derive(Debug, Default)]
pub struct AuthCounters {
    /// Requests that proved no tenant.
    pub unauthenticated: AtomicU64,
    /// Requests refused for a missing permission or someone else's ticket.
    pub permission_denied: AtomicU64,
    /// Requests refused by a quota.
    pub quota_refused: AtomicU64,
}
