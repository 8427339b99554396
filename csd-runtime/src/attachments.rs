//! Attachments: bytes several requests of one job share, sent to the node once
//! (`put_attachment`) and named in each request by their SHA-256. A join's key
//! filter is the first: every fragment of the probe table at this node applies the
//! same filter, and a table in 16 files would otherwise carry it 16 times.
//!
//! The node keeps an attachment within its memory budget (held in the
//! [`MemoryLedger`] like an upload's buffers) for [`KEEP`] after its last use, at
//! most [`MAX_ATTACHMENT`] bytes each and a sixteenth of the budget together (the
//! least recently used let go first). A request naming one it no longer keeps is
//! refused with [`Error::AttachmentMissing`]: its sender puts it again and asks
//! again, so letting go of one costs a round trip, never an answer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::error::{Error, Result};
use crate::memory::{Held, MemoryLedger};
use crate::protocol::ByteSize;
use crate::protocol::ModuleDigest;
use crate::protocol::stats::AttachmentStats;

/// Largest attachment accepted.
pub const MAX_ATTACHMENT: usize = 4 << 20;
/// How long an attachment is kept after its last use.
pub const KEEP: Duration = Duration::from_secs(60);
/// How long a put waits for memory: not at all. Its sender has the filter in hand
/// and sends it inline instead, which costs bytes, never a query's time.
const PATIENCE: Duration = Duration::ZERO;

struct Kept {
    bytes: Bytes,
    last_used: Instant,
    _held: Held,
}

/// The attachments a node keeps (see the module docs).
pub struct Attachments {
    memory: Arc<MemoryLedger>,
    /// Most bytes kept together.
    capacity: u64,
    kept: Mutex<HashMap<ModuleDigest, Kept>>,
    received: AtomicU64,
    used: AtomicU64,
    missing: AtomicU64,
}

impl std::fmt::Debug for Attachments {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (n, bytes) = self.figures();
        write!(f, "Attachments({n}, {bytes} bytes)")
    }
}

impl Attachments {
    /// Attachments held in `memory`, at most a sixteenth of its budget together (at
    /// least one largest attachment).
    pub fn new(memory: Arc<MemoryLedger>) -> Self {
        let capacity = (memory.budget() / 16).max(MAX_ATTACHMENT as u64);
        Attachments {
            memory,
            capacity,
            kept: Mutex::new(HashMap::new()),
            received: AtomicU64::new(0),
            used: AtomicU64::new(0),
            missing: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ModuleDigest, Kept>> {
        // A panic elsewhere while holding the lock leaves a consistent map.
        self.kept.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `bytes`, returning their digest (an attachment already kept is only
    /// touched). Too large: `INVALID_ARGUMENT`; no memory now (after the read cache
    /// and idle buffers let go): `RESOURCE_EXHAUSTED` with a retry hint.
    pub async fn put(&self, bytes: Bytes) -> Result<ModuleDigest> {
        if bytes.is_empty() || bytes.len() > MAX_ATTACHMENT {
            return Err(Error::InvalidArgument(format!(
                "an attachment is 1 to {} bytes, not {}",
                MAX_ATTACHMENT,
                bytes.len()
            )));
        }
        let digest = ModuleDigest::of(&bytes);
        let n = bytes.len() as u64;
        {
            let mut kept = self.lock();
            expire(&mut kept, Instant::now());
            if let Some(k) = kept.get_mut(&digest) {
                k.last_used = Instant::now();
                return Ok(digest);
            }
            // Room for it among the attachments: the least recently used go first.
            while total(&kept) + n > self.capacity {
                let Some(oldest) = kept
                    .iter()
                    .min_by_key(|(_, k)| k.last_used)
                    .map(|(d, _)| *d)
                else {
                    break;
                };
                kept.remove(&oldest);
            }
        }
        let held = self
            .memory
            .hold(n, &format!("an attachment of {}", ByteSize(n)), PATIENCE)
            .await?;
        self.lock().entry(digest).or_insert(Kept {
            bytes,
            last_used: Instant::now(),
            _held: held,
        });
        self.received.fetch_add(1, Ordering::Relaxed);
        Ok(digest)
    }

    /// The attachment named `digest`, or [`Error::AttachmentMissing`].
    pub fn get(&self, digest: &ModuleDigest) -> Result<Bytes> {
        let mut kept = self.lock();
        let now = Instant::now();
        expire(&mut kept, now);
        match kept.get_mut(digest) {
            Some(k) => {
                k.last_used = now;
                self.used.fetch_add(1, Ordering::Relaxed);
                Ok(k.bytes.clone())
            }
            None => {
                self.missing.fetch_add(1, Ordering::Relaxed);
                Err(Error::AttachmentMissing(*digest))
            }
        }
    }

    /// How many attachments are kept, and their bytes.
    pub fn figures(&self) -> (usize, u64) {
        let kept = self.lock();
        (kept.len(), total(&kept))
    }

    /// Its figures for `stats`.
    pub fn stats(&self) -> AttachmentStats {
        let (kept, bytes) = self.figures();
        AttachmentStats {
            kept,
            bytes,
            received: self.received.load(Ordering::Relaxed),
            used: self.used.load(Ordering::Relaxed),
            missing: self.missing.load(Ordering::Relaxed),
        }
    }
}

fn total(kept: &HashMap<ModuleDigest, Kept>) -> u64 {
    kept.values().map(|k| k.bytes.len() as u64).sum()
}

fn expire(kept: &mut HashMap<ModuleDigest, Kept>, now: Instant) {
    kept.retain(|_, k| now.duration_since(k.last_used) < KEEP);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn kept_by_digest_within_the_budget_and_let_go_of_when_full() {
        let memory = MemoryLedger::measuring(64 << 20, || Some(0));
        let a = Attachments::new(memory.clone());
        assert_eq!(a.capacity, MAX_ATTACHMENT as u64);
        let one = Bytes::from(vec![1u8; 3 << 20]);
        let d1 = a.put(one.clone()).await.unwrap();
        assert_eq!(d1, ModuleDigest::of(&one));
        assert_eq!(a.get(&d1).unwrap(), one);
        assert_eq!(memory.held(), 3 << 20);
        // The same bytes again: kept once.
        assert_eq!(a.put(one.clone()).await.unwrap(), d1);
        assert_eq!(a.figures(), (1, 3 << 20));
        // Another that does not fit beside it: the older one goes, and its memory.
        let two = Bytes::from(vec![2u8; 2 << 20]);
        let d2 = a.put(two).await.unwrap();
        assert_eq!(a.figures(), (1, 2 << 20));
        assert_eq!(memory.held(), 2 << 20);
        let e = a.get(&d1).unwrap_err();
        assert!(matches!(e, Error::AttachmentMissing(d) if d == d1), "{e:?}");
        assert!(a.get(&d2).is_ok());
    }

    #[tokio::test]
    async fn bad_sizes_are_refused_and_a_missing_one_names_its_digest() {
        let a = Attachments::new(MemoryLedger::measuring(64 << 20, || Some(0)));
        let e = a.put(Bytes::new()).await.unwrap_err().to_string();
        assert!(e.contains("1 to"), "{e}");
        let e = a
            .put(Bytes::from(vec![0u8; MAX_ATTACHMENT + 1]))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains(&MAX_ATTACHMENT.to_string()), "{e}");
        let d = ModuleDigest::of(b"never sent");
        let status = a.get(&d).unwrap_err().to_status();
        assert_eq!(status.code(), tonic::Code::NotFound);
        let back = crate::protocol::error::StatusDetail::of(&status);
        assert_eq!(
            back,
            Some(crate::protocol::error::StatusDetail::AttachmentMissing(d))
        );
    }
}
