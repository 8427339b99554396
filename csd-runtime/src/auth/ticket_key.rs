//! The key that seals the tickets a node hands out ([`TicketKey`]): HMAC-SHA256 over
//! tenant, expiry and ticket, kept on the device or in a file.

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{KeyInit, Mac};
use sha2::Sha256;

use super::principal::Principal;
use crate::error::{Error, Result, truncated};

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

    pub(super) fn mac(
        &self,
        ticket: &[u8],
        tenant: &str,
        expires_unix_ms: u64,
    ) -> hmac::Hmac<Sha256> {
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
