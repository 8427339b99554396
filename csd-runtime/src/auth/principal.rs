//! Who a request is ([`Principal`]): its tenant (or none, on an open node) and the
//! checks every RPC asks of it: permissions on tables and objects, quotas, request
//! slots ([`RequestSlot`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::permission::{AuthCounters, Permission};
use super::tenants::Tenant;
use crate::error::{Error, Result, truncated};
use csd_protocol::ByteSize;

/// Who a request is, and what it may do.
#[derive(Clone)]
pub struct Principal {
    pub(super) name: String,
    pub(super) tenant: Option<Arc<Tenant>>,
    pub(super) counters: Arc<AuthCounters>,
    pub(super) in_flight: Option<Arc<AtomicUsize>>,
}

impl Principal {
    /// A principal that may do anything (auth off), as tenant `name`.
    pub fn anyone(name: &str) -> Self {
        Principal {
            name: name.to_string(),
            tenant: None,
            counters: Arc::default(),
            in_flight: None,
        }
    }

    /// The tenant's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The proven tenant (`None` with auth off).
    pub fn tenant(&self) -> Option<&Tenant> {
        self.tenant.as_deref()
    }

    fn deny(&self, message: String) -> Error {
        self.counters
            .permission_denied
            .fetch_add(1, Ordering::Relaxed);
        Error::PermissionDenied(message)
    }

    /// Whether it may do `p` to `table` (without counting a refusal).
    pub fn may(&self, p: Permission, table: &str) -> bool {
        self.tenant.as_ref().is_none_or(|t| t.may(p, table))
    }

    /// `Ok` if it may do `p` to `table`, else `PERMISSION_DENIED` naming both.
    pub fn check(&self, p: Permission, table: &str) -> Result<()> {
        match &self.tenant {
            Some(t) if !t.may(p, table) => Err(self.deny(format!(
                "tenant {} may not {} table {}{}",
                t.name,
                p.as_str(),
                truncated(table),
                if t.covers(table) {
                    format!(" (it lacks the '{}' permission)", p.as_str())
                } else {
                    " (the table is not in its tables)".into()
                }
            ))),
            _ => Ok(()),
        }
    }

    /// `Ok` if it has `admin`, else `PERMISSION_DENIED` saying `what` needs it.
    pub fn check_admin(&self, what: &str) -> Result<()> {
        match &self.tenant {
            Some(t) if !t.has(Permission::Admin) => Err(self.deny(format!(
                "tenant {} may not {what}: that needs the 'admin' permission",
                t.name
            ))),
            _ => Ok(()),
        }
    }

    /// `Ok` if it has `p` on some table, for requests that name none yet.
    pub fn check_any(&self, p: Permission, what: &str) -> Result<()> {
        match &self.tenant {
            Some(t) if !t.has(p) => Err(self.deny(format!(
                "tenant {} may not {what}: that needs the '{}' permission",
                t.name,
                p.as_str()
            ))),
            _ => Ok(()),
        }
    }

    /// `Ok` if it may read raw bytes of `object`: an object of a table it may read
    /// (or any table's, for an admin); never the node's own objects (`.csd/`).
    pub fn check_object_read(&self, object: &str) -> Result<()> {
        if object.starts_with(".csd/") {
            return Err(self.refuse(format!(
                "object {} is the node's own and is not served",
                crate::error::truncated(object)
            )));
        }
        match crate::table::parse_object_name(object) {
            Some((table, _, _)) if self.may(Permission::Read, table) => Ok(()),
            _ => self.check_admin(&format!(
                "read raw bytes of object {}",
                crate::error::truncated(object)
            )),
        }
    }

    /// A `PERMISSION_DENIED` refusal saying `why`, counted.
    pub fn refuse(&self, why: String) -> Error {
        self.deny(why)
    }

    /// One of its concurrent-request slots (held until the guard drops), or
    /// `RESOURCE_EXHAUSTED` naming the quota.
    pub fn request_slot(&self) -> Result<RequestSlot> {
        let (Some(t), Some(n)) = (&self.tenant, &self.in_flight) else {
            return Ok(RequestSlot(None));
        };
        let limit = t.max_requests.unwrap_or(usize::MAX);
        let before = n.fetch_add(1, Ordering::AcqRel);
        if before >= limit {
            n.fetch_sub(1, Ordering::AcqRel);
            self.counters.quota_refused.fetch_add(1, Ordering::Relaxed);
            return Err(Error::ResourcesExhausted(format!(
                "tenant {} has {before} requests at this node, its max_requests quota is {limit}",
                t.name
            )));
        }
        Ok(RequestSlot(Some(n.clone())))
    }

    /// `Ok` if storing `adding` more bytes keeps `stored` (the bytes of the tables it
    /// may write) within its quota.
    pub fn check_stored(&self, stored: u64, adding: u64) -> Result<()> {
        let Some(t) = &self.tenant else {
            return Ok(());
        };
        match t.max_stored_bytes {
            Some(limit) if stored.saturating_add(adding) > limit => {
                self.counters.quota_refused.fetch_add(1, Ordering::Relaxed);
                Err(Error::ResourcesExhausted(format!(
                    "tenant {}'s tables would hold more than its max_stored_bytes quota of {} ({} stored, {} more sent); nothing was stored",
                    t.name,
                    ByteSize(limit),
                    stored,
                    adding
                )))
            }
            _ => Ok(()),
        }
    }
}

/// A concurrent-request slot of a tenant; freed on drop.
pub struct RequestSlot(Option<Arc<AtomicUsize>>);

impl Drop for RequestSlot {
    fn drop(&mut self) {
        if let Some(n) = &self.0 {
            n.fetch_sub(1, Ordering::AcqRel);
        }
    }
}
