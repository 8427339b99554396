//! Who may do what at a node.
//!
//! With `csd serve --auth tenants.toml`, every request must prove a tenant: a bearer
//! token (`authorization: Bearer <token>`, Arrow Flight's convention) whose SHA-256
//! digest the file lists, or, over mutual TLS, a client certificate whose subject
//! common name the file maps to a tenant. The `csd-tenant` header is then ignored.
//! Each tenant may touch some tables (exact names, `*`, or `prefix*`) with some
//! permissions:
//!
//! | permission | allows |
//! |---|---|
//! | `read` | list and describe the tables, scan them, run operators over them, read ranges of their objects |
//! | `write` | store objects in them (`DoPut`) |
//! | `delete` | delete them or their partitions |
//! | `code` | ship code to run at the node (operators that run user code) |
//! | `admin` | node figures (`stats`), the object list, raw ranges of any table's objects |
//!
//! A missing or unknown token is `UNAUTHENTICATED`; a known tenant doing what it may
//! not is `PERMISSION_DENIED` naming the table and the permission. Quotas (stored
//! bytes of the tables a tenant may write, requests at once) are `RESOURCE_EXHAUSTED`
//! naming the quota. The file is re-read by [`Auth::reload`] (on `SIGHUP`), without
//! dropping connections.
//!
//! Tickets the node hands out (in `FlightInfo` endpoints) are sealed by
//! [`TicketKey`]: bound to the tenant, with an expiry, and an HMAC-SHA256 over both and
//! the ticket. A sealed ticket used by another tenant, after its expiry, or altered is
//! refused; a ticket built by hand carries no seal and passes the same permission
//! checks as any other request.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::admission::TenantShare;
use crate::error::{Error, Result};

mod permission;
mod principal;
mod tenants;
#[cfg(test)]
mod tests;
mod ticket_key;

pub use csd_protocol::credential::{Credential, parse_authorization};
pub use permission::{AuthCounters, Permission};
pub use principal::{Principal, RequestSlot};
pub use tenants::{Tenant, TenantSpec, new_token, parse_tenants, token_digest};
pub use ticket_key::{TICKET_KEY_OBJECT, TicketKey};

/// The metadata key of a request's credentials.
pub use csd_protocol::AUTHORIZATION;

/// The node's tenants (or none: auth off), reloadable.
pub struct Auth {
    source: Option<PathBuf>,
    tenants: RwLock<Arc<Vec<Arc<Tenant>>>>,
    in_flight: Mutex<HashMap<String, Arc<AtomicUsize>>>,
    /// Refusals.
    pub counters: Arc<AuthCounters>,
}

impl Auth {
    /// No authentication: every request is served, its tenant is what it names.
    pub fn open() -> Self {
        Auth {
            source: None,
            tenants: RwLock::new(Arc::new(Vec::new())),
            in_flight: Mutex::new(HashMap::new()),
            counters: Arc::default(),
        }
    }

    /// Tenants from the file at `path`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let auth = Auth {
            source: Some(path.to_path_buf()),
            ..Auth::open()
        };
        auth.reload()?;
        Ok(auth)
    }

    /// Tenants from `text` (tests; no file to reload).
    pub fn from_text(text: &str) -> Result<Self> {
        let auth = Auth::open();
        auth.set(parse_tenants(text, "tenants")?);
        if auth.tenants().is_empty() {
            return Err(Error::InvalidArgument("tenants: no [[tenant]]".into()));
        }
        Ok(auth)
    }

    fn set(&self, tenants: Vec<Tenant>) {
        *self.tenants.write().unwrap_or_else(|p| p.into_inner()) =
            Arc::new(tenants.into_iter().map(Arc::new).collect());
    }

    /// Re-reads the tenants file; on any error the tenants stay as they were.
    /// Returns how many tenants it lists.
    pub fn reload(&self) -> Result<usize> {
        let Some(path) = &self.source else {
            return Ok(self.tenants().len());
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("reading the tenants file {}", path.display()), e))?;
        let tenants = parse_tenants(&text, &path.display().to_string())?;
        if tenants.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "{}: no [[tenant]]: every request would be refused",
                path.display()
            )));
        }
        let n = tenants.len();
        self.set(tenants);
        Ok(n)
    }

    /// Whether requests must prove a tenant.
    pub fn enabled(&self) -> bool {
        !self.tenants().is_empty()
    }

    fn tenants(&self) -> Arc<Vec<Arc<Tenant>>> {
        self.tenants
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Whether the tenants file names tenant `name`.
    pub fn knows(&self, name: &str) -> bool {
        self.tenants().iter().any(|t| t.name == name)
    }

    /// The tenants' admission shares.
    pub fn shares(&self) -> BTreeMap<String, TenantShare> {
        self.tenants()
            .iter()
            .map(|t| (t.name.clone(), t.share))
            .collect()
    }

    /// The tenant `token` proves, comparing digests in constant time.
    fn by_token(&self, token: &str) -> Option<Arc<Tenant>> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let mut found = None;
        for t in self.tenants().iter() {
            if let Some(d) = &t.digest
                && bool::from(d.ct_eq(&digest))
            {
                found = Some(t.clone());
            }
        }
        found
    }

    /// The tenant a verified client certificate (DER) proves, by its subject's
    /// common name.
    fn by_certificate(&self, der: &[u8]) -> Option<Arc<Tenant>> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
        let cn = cert.subject().iter_common_name().next()?.as_str().ok()?;
        self.tenants()
            .iter()
            .find(|t| t.cert_subject.as_deref() == Some(cn))
            .cloned()
    }

    /// Who a request is. `authorization` is its metadata value, `certificate` its
    /// verified client certificate (mutual TLS), `named` the tenant it names itself
    /// (used only when auth is off).
    pub fn principal(
        &self,
        authorization: Option<&[u8]>,
        certificate: Option<&[u8]>,
        named: &str,
    ) -> Result<Principal> {
        if !self.enabled() {
            return Ok(Principal {
                name: named.to_string(),
                tenant: None,
                counters: self.counters.clone(),
                in_flight: None,
            });
        }
        let found = match authorization {
            Some(v) => match parse_authorization(v) {
                Ok(Credential::Bearer(token)) => self.by_token(&token).ok_or_else(|| {
                    Error::Unauthenticated("the token is not known to this node".into())
                }),
                Ok(Credential::Basic { user, password }) => self
                    .by_token(&password)
                    .filter(|t| t.name == user)
                    .ok_or_else(|| {
                        Error::Unauthenticated(
                            "that tenant name and token are not known to this node".into(),
                        )
                    }),
                Err(e) => Err(e),
            },
            None => certificate.and_then(|c| self.by_certificate(c)).ok_or_else(|| {
                Error::Unauthenticated(
                    "this node requires a token: send 'authorization: Bearer <token>' (csd: --token or CSD_TOKEN)".into(),
                )
            }),
        };
        match found {
            Ok(tenant) => {
                let in_flight = tenant.max_requests.map(|_| {
                    self.in_flight
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .entry(tenant.name.clone())
                        .or_default()
                        .clone()
                });
                Ok(Principal {
                    name: tenant.name.clone(),
                    tenant: Some(tenant),
                    counters: self.counters.clone(),
                    in_flight,
                })
            }
            Err(e) => {
                self.counters
                    .unauthenticated
                    .fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }
}
