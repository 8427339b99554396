//! The tenants file: who the tenants are (token digests, certificate subjects),
//! what they may touch, their shares and quotas ([`parse_tenants`], [`Tenant`]).

use std::collections::BTreeSet;

use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::permission::Permission;
use crate::admission::TenantShare;
use crate::error::{Error, Result, truncated};
use csd_protocol::ByteSize;
use csd_protocol::digest::{hex, unhex32};

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
    pub(super) digest: Option<[u8; 32]>,
    pub(super) cert_subject: Option<String>,
    pub(super) tables: Vec<String>,
    pub(super) can: BTreeSet<Permission>,
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
