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

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{KeyInit, Mac};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::admission::TenantShare;
use crate::error::{Error, Result, truncated};
use csd_protocol::ByteSize;
use csd_protocol::digest::{hex, unhex32};

/// The metadata key of a request's credentials.
pub use csd_protocol::AUTHORIZATION;
/// Longest token accepted.
const MAX_TOKEN_BYTES: usize = 4096;

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

/// One `[[tenant]]` of the tenants file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    /// Name (admission shares the node's CPU by it).
    pub name: String,
    /// Hex SHA-256 of the tenant's bearer token (`csd auth hash` prints it).
    #[serde(default)]
    pub token_sha256: Option<String>,
    /// The common name of a client certificate that proves this tenant (mutual TLS).
    #[serde(default)]
    pub cert_subject: Option<String>,
    /// Tables it may touch: names, `*`, or `prefix*`.
    #[serde(default)]
    pub tables: Vec<String>,
    /// What it may do with them.
    #[serde(default)]
    pub can: Vec<Permission>,
    /// Relative share of the node's CPU slots when tenants wait.
    #[serde(default = "one")]
    pub weight: f64,
    /// CPU slots held back for it while it has work.
    #[serde(default)]
    pub reserve: usize,
    /// Largest total stored size of the tables it may write.
    #[serde(default)]
    pub max_stored_bytes: Option<ByteSize>,
    /// Most requests it may have at the node at once.
    #[serde(default)]
    pub max_requests: Option<usize>,
}

fn one() -> f64 {
    1.0
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantsFile {
    #[serde(default)]
    tenant: Vec<TenantSpec>,
}

/// A tenant as the node checks it.
#[derive(Debug)]
pub struct Tenant {
    /// Name.
    pub name: String,
    digest: Option<[u8; 32]>,
    cert_subject: Option<String>,
    tables: Vec<String>,
    can: BTreeSet<Permission>,
    /// Admission weight and reserve.
    pub share: TenantShare,
    /// Stored-bytes quota.
    pub max_stored_bytes: Option<u64>,
    /// Concurrent-requests quota.
    pub max_requests: Option<usize>,
}

impl Tenant {
    /// Whether its table patterns cover `table`.
    pub fn covers(&self, table: &str) -> bool {
        self.tables.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) => table.starts_with(prefix),
            None => p == table,
        })
    }

    /// Whether it has `p`.
    pub fn has(&self, p: Permission) -> bool {
        self.can.contains(&p)
    }

    /// Whether it may do `p` to `table`.
    pub fn may(&self, p: Permission, table: &str) -> bool {
        self.has(p) && self.covers(table)
    }
}

/// SHA-256 of `token`, in hex: what the tenants file stores.
pub fn token_digest(token: &str) -> String {
    hex(&Sha256::digest(token.as_bytes()))
}

/// A new random token (32 bytes, hex).
pub fn new_token() -> String {
    let mut b = [0u8; 32];
    rand::fill(&mut b);
    hex(&b)
}

/// Parses and checks a tenants file's text; `origin` names it in errors.
pub fn parse_tenants(text: &str, origin: &str) -> Result<Vec<Tenant>> {
    let file: TenantsFile =
        toml::from_str(text).map_err(|e| Error::InvalidArgument(format!("{origin}: {e}")))?;
    let bad = |m: String| Error::InvalidArgument(format!("{origin}: {m}"));
    let mut names = BTreeSet::new();
    let mut digests = BTreeSet::new();
    let mut out = Vec::with_capacity(file.tenant.len());
    for t in file.tenant {
        let valid_name = !t.name.is_empty()
            && t.name.len() <= 64
            && t.name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
        if !valid_name {
            return Err(bad(format!(
                "tenant name {:?} must be 1 to 64 letters, digits, '_', '.' or '-'",
                truncated(&t.name)
            )));
        }
        if !names.insert(t.name.clone()) {
            return Err(bad(format!("tenant {} is listed twice", t.name)));
        }
        let digest = match &t.token_sha256 {
            Some(d) => {
                let d = unhex32(d).ok_or_else(|| {
                    bad(format!(
                        "tenant {}: token_sha256 must be 64 hex digits (the SHA-256 of the token; `csd auth hash` prints it)",
                        t.name
                    ))
                })?;
                if !digests.insert(d) {
                    return Err(bad(format!(
                        "tenant {}: another tenant has the same token",
                        t.name
                    )));
                }
                Some(d)
            }
            None => None,
        };
        if digest.is_none() && t.cert_subject.is_none() {
            return Err(bad(format!(
                "tenant {} has neither token_sha256 nor cert_subject: nothing could prove it",
                t.name
            )));
        }
        for p in &t.tables {
            let body = p.strip_suffix('*').unwrap_or(p);
            if body.contains('*') || (body.is_empty() && p != "*") {
                return Err(bad(format!(
                    "tenant {}: table pattern {:?} must be a name, * or prefix*",
                    t.name,
                    truncated(p)
                )));
            }
        }
        if !(t.weight.is_finite() && t.weight > 0.0) {
            return Err(bad(format!(
                "tenant {}: weight {} must be a positive number",
                t.name, t.weight
            )));
        }
        if t.max_requests == Some(0) {
            return Err(bad(format!(
                "tenant {}: max_requests 0 would refuse everything; leave it out for no limit",
                t.name
            )));
        }
        out.push(Tenant {
            digest,
            cert_subject: t.cert_subject,
            tables: t.tables,
            can: t.can.into_iter().collect(),
            share: TenantShare {
                weight: t.weight,
                reserve: t.reserve,
            },
            max_stored_bytes: t.max_stored_bytes.map(ByteSize::bytes),
            max_requests: t.max_requests,
            name: t.name,
        });
    }
    Ok(out)
}

/// Credentials a request carries in its `authorization` metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Credential {
    /// `Bearer <token>`.
    Bearer(String),
    /// `Basic base64(user:password)` (Flight's `Handshake` with basic auth).
    Basic {
        /// The tenant name.
        user: String,
        /// Its token.
        password: String,
    },
}

/// Parses an `authorization` value. Never panics on any bytes.
pub fn parse_authorization(value: &[u8]) -> Result<Credential> {
    let malformed = || {
        Error::Unauthenticated(
            "the authorization metadata must be 'Bearer <token>' (or 'Basic <base64 of tenant:token>' for a Flight handshake)".into(),
        )
    };
    if value.len() > MAX_TOKEN_BYTES + 16 {
        return Err(Error::Unauthenticated(format!(
            "the authorization metadata is longer than {MAX_TOKEN_BYTES} bytes"
        )));
    }
    let text = std::str::from_utf8(value).map_err(|_| malformed())?.trim();
    let (scheme, rest) = text.split_once(' ').ok_or_else(malformed)?;
    let rest = rest.trim();
    let visible = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_graphic());
    if scheme.eq_ignore_ascii_case("bearer") {
        if !visible(rest) {
            return Err(malformed());
        }
        return Ok(Credential::Bearer(rest.to_string()));
    }
    if scheme.eq_ignore_ascii_case("basic") {
        use base64::Engine;
        let raw = base64::engine::general_purpose::STANDARD
            .decode(rest)
            .map_err(|_| malformed())?;
        let raw = String::from_utf8(raw).map_err(|_| malformed())?;
        let (user, password) = raw.split_once(':').ok_or_else(malformed)?;
        if user.is_empty() || !visible(password) {
            return Err(malformed());
        }
        return Ok(Credential::Basic {
            user: user.to_string(),
            password: password.to_string(),
        });
    }
    Err(malformed())
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

/// Who a request is, and what it may do.
#[derive(Clone)]
pub struct Principal {
    name: String,
    tenant: Option<Arc<Tenant>>,
    counters: Arc<AuthCounters>,
    in_flight: Option<Arc<AtomicUsize>>,
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

/// The key that seals tickets (HMAC-SHA256).
#[derive(Clone)]
pub struct TicketKey([u8; 32]);

impl std::fmt::Debug for TicketKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TicketKey(…)")
    }
}

/// Where the node keeps its ticket key on its device.
pub const TICKET_KEY_OBJECT: &str = ".csd/ticket-key";

impl TicketKey {
    /// A new random key.
    pub fn random() -> Self {
        let mut k = [0u8; 32];
        rand::fill(&mut k);
        TicketKey(k)
    }

    /// A key from stored bytes (at least 32).
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        let k: [u8; 32] = b.get(..32).and_then(|s| s.try_into().ok()).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "a ticket key needs 32 bytes, this one has {}",
                b.len()
            ))
        })?;
        Ok(TicketKey(k))
    }

    /// The key's bytes (to store it).
    pub fn bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The key in the file at `path`, created (mode 0600, random) if it is missing.
    pub fn from_file(path: &Path) -> Result<Self> {
        match std::fs::read(path) {
            Ok(b) => Self::from_bytes(&b).map_err(|e| {
                Error::InvalidArgument(format!("ticket key file {}: {e}", path.display()))
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let key = Self::random();
                use std::io::Write;
                use std::os::unix::fs::OpenOptionsExt;
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(path)
                    .map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
                f.write_all(&key.0)
                    .and_then(|()| f.sync_all())
                    .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
                Ok(key)
            }
            Err(e) => Err(Error::io(format!("reading {}", path.display()), e)),
        }
    }

    fn mac(&self, ticket: &[u8], tenant: &str, expires_unix_ms: u64) -> hmac::Hmac<Sha256> {
        let mut m = <hmac::Hmac<Sha256> as KeyInit>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        m.update(b"csd-ticket-v1\0");
        m.update(&(tenant.len() as u64).to_le_bytes());
        m.update(tenant.as_bytes());
        m.update(&expires_unix_ms.to_le_bytes());
        m.update(ticket);
        m
    }

    /// `ticket` (an encoded ticket) sealed for `tenant` until `ttl` from now.
    pub fn seal(&self, ticket: Vec<u8>, tenant: &str, ttl: Duration) -> Vec<u8> {
        self.seal_until(ticket, tenant, unix_ms(SystemTime::now() + ttl))
    }

    /// `ticket` sealed for `tenant` until `expires_unix_ms` (`u64::MAX`: the seal
    /// never expires, for tickets whose target has its own lifetime, as a kept
    /// result's).
    pub fn seal_until(&self, ticket: Vec<u8>, tenant: &str, expires_unix_ms: u64) -> Vec<u8> {
        let mac = self
            .mac(&ticket, tenant, expires_unix_ms)
            .finalize()
            .into_bytes()
            .to_vec();
        crate::protocol::ticket::Seal {
            ticket,
            tenant: tenant.to_string(),
            expires_unix_ms,
            mac,
        }
        .encode()
    }

    /// Checks `seal` for `who`: made with this key, not expired, and issued to the
    /// same tenant (when auth is on).
    pub fn verify(&self, seal: &crate::protocol::ticket::Seal, who: &Principal) -> Result<()> {
        let m = self.mac(&seal.ticket, &seal.tenant, seal.expires_unix_ms);
        if m.verify_slice(&seal.mac).is_err() {
            return Err(who.refuse(
                "the ticket's signature does not verify: it was altered, or issued by another node"
                    .into(),
            ));
        }
        let now = unix_ms(SystemTime::now());
        if now > seal.expires_unix_ms {
            return Err(who.refuse(format!(
                "the ticket expired {} s ago: ask for a new one (GetFlightInfo)",
                (now - seal.expires_unix_ms) / 1000
            )));
        }
        if who.tenant().is_some() && seal.tenant != who.name() {
            return Err(who.refuse(format!(
                "the ticket was issued to tenant {}, not to {}",
                truncated(&seal.tenant),
                who.name()
            )));
        }
        Ok(())
    }
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ETL: &str = r#"
[[tenant]]
name = "etl"
token_sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
tables = ["lineitem", "orders"]
can = ["read", "write"]
weight = 3
reserve = 1

[[tenant]]
name = "ops"
token_sha256 = "60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752"
tables = ["*"]
can = ["read", "delete", "admin"]
max_requests = 1
"#;

    #[test]
    fn the_issue_example_parses_and_checks() {
        let auth = Auth::from_text(ETL).unwrap();
        assert!(ETL.contains(&token_digest("test")));
        let p = auth
            .principal(Some(b"Bearer test"), None, "whatever")
            .unwrap();
        assert_eq!(p.name(), "etl");
        p.check(Permission::Read, "orders").unwrap();
        p.check(Permission::Write, "lineitem").unwrap();
        let e = p.check(Permission::Delete, "orders").unwrap_err();
        assert!(e.to_string().contains("lacks the 'delete'"), "{e}");
        let e = p.check(Permission::Read, "part").unwrap_err();
        assert!(e.to_string().contains("not in its tables"), "{e}");
        assert_eq!(e.status_code(), crate::StatusCode::PermissionDenied);
        assert!(p.check_admin("read node figures").is_err());
        assert_eq!(auth.shares()["etl"].weight, 3.0);
        assert_eq!(auth.shares()["etl"].reserve, 1);
        assert_eq!(auth.counters.permission_denied.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn unknown_missing_and_malformed_credentials_are_unauthenticated() {
        let auth = Auth::from_text(ETL).unwrap();
        for bad in [
            &b"Bearer nope"[..],
            b"Bearer",
            b"Bearer  ",
            b"Token test",
            b"\xff\xfe",
            b"Basic !!!",
            b"Basic ZXRsOnRlc3Q=x",
        ] {
            let e = auth.principal(Some(bad), None, "etl").err().unwrap();
            assert_eq!(
                e.status_code(),
                crate::StatusCode::Unauthenticated,
                "{bad:?}"
            );
        }
        let e = auth.principal(None, None, "etl").err().unwrap();
        assert!(e.to_string().contains("requires a token"), "{e}");
        // Basic etl:test is the handshake form; the name must match the token's.
        assert_eq!(
            auth.principal(Some(b"Basic ZXRsOnRlc3Q="), None, "")
                .unwrap()
                .name(),
            "etl"
        );
        assert!(
            auth.principal(Some(b"Basic b3BzOnRlc3Q="), None, "")
                .is_err()
        );
        assert_eq!(auth.counters.unauthenticated.load(Ordering::Relaxed), 9);
    }

    #[test]
    fn quotas_and_patterns() {
        let auth = Auth::from_text(ETL).unwrap();
        assert!(auth.principal(Some(b"Bearer ops-token"), None, "").is_err());
        let text = ETL.replace(
            "60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752",
            &token_digest("ops-token"),
        );
        let auth = Auth::from_text(&text).unwrap();
        let ops = auth.principal(Some(b"bearer ops-token"), None, "").unwrap();
        assert!(ops.may(Permission::Read, "anything"));
        let slot = ops.request_slot().unwrap();
        let e = ops.request_slot().err().unwrap();
        assert!(e.to_string().contains("max_requests"), "{e}");
        drop(slot);
        let _again = ops.request_slot().unwrap();
        let t = Tenant {
            name: "x".into(),
            digest: None,
            cert_subject: None,
            tables: vec!["tpch_*".into()],
            can: [Permission::Read].into(),
            share: TenantShare::default(),
            max_stored_bytes: None,
            max_requests: None,
        };
        assert!(t.may(Permission::Read, "tpch_lineitem"));
        assert!(!t.may(Permission::Read, "tpc"));
    }

    #[test]
    fn random_metadata_never_panics_nor_proves_a_tenant() {
        let auth = Auth::from_text(ETL).unwrap();
        let mut x = 0x9e37_79b9u32;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        };
        for seed in [&b"Bearer test"[..], b"Basic ZXRsOnRlc3Q=", b"bearer x"] {
            for _ in 0..3000 {
                let mut v = seed.to_vec();
                for _ in 0..1 + next() % 3 {
                    let i = next() as usize % v.len();
                    match next() % 3 {
                        0 => v[i] = next() as u8,
                        1 => v.insert(i, next() as u8),
                        _ => {
                            v.remove(i);
                            if v.is_empty() {
                                v.push(b' ');
                            }
                        }
                    }
                }
                match auth.principal(Some(&v), None, "etl") {
                    Ok(p) => {
                        // Only the real token (or the scheme's spelling) still proves it.
                        let t = match parse_authorization(&v).unwrap() {
                            Credential::Bearer(t) => t,
                            Credential::Basic { password, .. } => password,
                        };
                        assert_eq!((p.name(), t.as_str()), ("etl", "test"), "{v:?}");
                    }
                    Err(e) => assert_eq!(e.status_code(), crate::StatusCode::Unauthenticated),
                }
            }
        }
    }

    #[test]
    fn bad_files_name_what_is_wrong() {
        for (text, says) in [
            ("[[tenant]]\nname = \"a\"\n", "neither token_sha256"),
            (
                "[[tenant]]\nname = \"a\"\ntoken_sha256 = \"abc\"\n",
                "64 hex digits",
            ),
            (
                "[[tenant]]\nname = \"a b\"\ncert_subject = \"a\"\n",
                "tenant name",
            ),
            (
                "[[tenant]]\nname = \"a\"\ncert_subject = \"a\"\ncan = [\"fly\"]\n",
                "fly",
            ),
            (
                "[[tenant]]\nname = \"a\"\ncert_subject = \"a\"\ntables = [\"a*b\"]\n",
                "pattern",
            ),
            (
                "[[tenant]]\nname = \"a\"\ncert_subject = \"a\"\ntoken = \"x\"\n",
                "token",
            ),
        ] {
            let e = parse_tenants(text, "t.toml").err().unwrap().to_string();
            assert!(e.contains(says), "{text}: {e}");
        }
    }

    #[test]
    fn seals_bind_tenant_expiry_and_bytes() {
        let auth = Auth::from_text(ETL).unwrap();
        let etl = auth.principal(Some(b"Bearer test"), None, "").unwrap();
        let key = TicketKey::random();
        let sealed = key.seal(b"\x01ticket".to_vec(), "etl", Duration::from_secs(60));
        let seal = crate::protocol::ticket::Seal::decode(&sealed).unwrap();
        key.verify(&seal, &etl).unwrap();
        let other = Principal {
            name: "ops".into(),
            tenant: auth.tenants().iter().find(|t| t.name == "ops").cloned(),
            counters: auth.counters.clone(),
            in_flight: None,
        };
        assert!(
            key.verify(&seal, &other)
                .unwrap_err()
                .to_string()
                .contains("issued to tenant etl")
        );
        let mut altered = seal.clone();
        altered.ticket[1] ^= 1;
        assert!(key.verify(&altered, &etl).is_err());
        assert!(TicketKey::random().verify(&seal, &etl).is_err());
        let old = key.seal(b"\x01t".to_vec(), "etl", Duration::ZERO);
        let mut old = crate::protocol::ticket::Seal::decode(&old).unwrap();
        old.expires_unix_ms -= 5000;
        // Re-sealed with the old expiry so only the time is wrong.
        old.mac = key
            .mac(&old.ticket, &old.tenant, old.expires_unix_ms)
            .finalize()
            .into_bytes()
            .to_vec();
        assert!(
            key.verify(&old, &etl)
                .unwrap_err()
                .to_string()
                .contains("expired")
        );
    }
}
