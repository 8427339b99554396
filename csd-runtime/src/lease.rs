//! Leased slots (rFaaS's idea on a storage node): a client leases N of the node's
//! CPU slots for a while and invokes shipped Wasm functions on them without
//! admission queueing — **hot** (the lease keeps an instance of the module),
//! **warm** (the module is compiled, a new instance is made) or **cold** (the node
//! lacks the module: `NOT_FOUND` naming it, the client sends it once).
//!
//! Admission grants a lease only out of what the node can spare now (idle slots,
//! leaving the tenants' reserves and at least one slot to everyone else) and
//! otherwise refuses it (`RESOURCE_EXHAUSTED` with a retry hint: the earliest
//! expiry of the leases held). While it lasts, admitted work sees fewer slots; the
//! slots come back at expiry, on release, or — for a lease granted with an idle
//! limit — once its holder has been silent (no invocation, no `touch_lease`) that
//! long: a client that disappears does not keep the slots.
//!
//! Invocations use the SQL-function ABI of the guest SDK (`export_functions!`):
//! one Arrow IPC batch of arguments in, one column out.
//!
//! Operator requests (`csd run`, pushed SQL fragments) of the lease's tenant run on
//! it too when they name it (the `csd-lease` header: lease ids, comma-separated, of
//! any nodes; each node uses the one it holds): they skip admission's queue and are
//! never handed back for queueing. One that does not fit the lease's memory (or,
//! for a lease without memory of its own, the node's free memory) goes through
//! admission as usual.
//!
//! Fairness: a lease of N slots counts as N of its tenant's `max_requests` while it
//! lasts (the calls on it take no more) and toward its tenant's reserve; a lease
//! never takes the node below the other tenants' reserves.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::admission::Admission;
use crate::error::{Error, Result, truncated};
use crate::sandbox::{GuestInstance, ModuleDigest, Sandbox};
pub use csd_protocol::actions::{LeaseIds, LeaseInfo, Start};
use csd_protocol::refs::now_unix_ms;
pub use csd_protocol::stats::LeaseStats;

struct Lease {
    info: LeaseInfo,
    /// When its holder was last heard of (ms since the Unix epoch).
    seen: AtomicU64,
    /// Instances kept warm on the lease, by module.
    hot: std::sync::Mutex<HashMap<ModuleDigest, GuestInstance>>,
    cancel: Arc<AtomicBool>,
    /// One permit per leased slot: at most that many calls run at once.
    running: Arc<tokio::sync::Semaphore>,
    /// Of [`LeaseInfo::memory`], what the requests running on it hold.
    memory_used: AtomicU64,
    /// The admission bucket it was leased from.
    bucket: String,
    /// Its tenant's request slots (`max_requests`) it holds.
    _quota: Vec<crate::auth::RequestSlot>,
}

impl Lease {
    /// Whether it has ended at `now`: expired, or its holder silent past its idle
    /// limit.
    fn over(&self, now: u64) -> bool {
        now >= self.info.expires_unix_ms
            || self
                .info
                .idle_ms
                .is_some_and(|i| now >= self.seen.load(Ordering::Relaxed).saturating_add(i))
    }
}

/// What a lease is asked for.
pub struct Grant {
    /// The tenant asking (its name in the lease).
    pub tenant: String,
    /// Its admission bucket.
    pub bucket: String,
    /// CPU slots.
    pub slots: usize,
    /// Memory for the requests run on it (0: none of its own).
    pub memory: u64,
    /// How long.
    pub ttl: Duration,
    /// The longest lease this node grants.
    pub max_ttl: Duration,
    /// End it once its holder is silent this long.
    pub idle: Option<Duration>,
    /// The tenant's request slots it holds while it lasts.
    pub quota: Vec<crate::auth::RequestSlot>,
}

/// Where a request run on a lease holds its memory.
enum Held {
    Lease(u64),
    Node(Arc<Admission>, u64),
}

/// An operator request's slot on a lease; gives back its slot and memory on drop.
pub struct LeaseRun {
    lease: Arc<Lease>,
    _permit: tokio::sync::OwnedSemaphorePermit,
    memory: Held,
    /// How long it waited for one of the lease's slots.
    pub waited: Duration,
}

impl LeaseRun {
    /// The lease's id.
    pub fn id(&self) -> &str {
        &self.lease.info.id
    }
}

impl Drop for LeaseRun {
    fn drop(&mut self) {
        match &self.memory {
            Held::Lease(m) => {
                self.lease.memory_used.fetch_sub(*m, Ordering::AcqRel);
            }
            Held::Node(adm, m) => adm.give_memory(*m),
        }
    }
}

/// The leases of a node.
#[derive(Default)]
pub struct Leases {
    leases: std::sync::Mutex<HashMap<String, Arc<Lease>>>,
    granted: AtomicU64,
    refused: AtomicU64,
    expired: AtomicU64,
    runs: AtomicU64,
}

impl Leases {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Lease>>> {
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Grants `ask` or refuses with why and when to retry.
    pub fn grant(&self, admission: &Admission, ask: Grant) -> Result<LeaseInfo> {
        let Grant {
            tenant,
            bucket,
            slots,
            memory,
            ttl,
            max_ttl,
            idle,
            quota,
        } = ask;
        if ttl.is_zero() || ttl > max_ttl {
            return Err(Error::InvalidArgument(format!(
                "a lease lasts from 1 ms to {} s on this node; {} ms was asked",
                max_ttl.as_secs(),
                ttl.as_millis()
            )));
        }
        if let Err(why) = admission.lease(&bucket, slots, memory) {
            self.refused.fetch_add(1, Ordering::Relaxed);
            let now = now_unix_ms();
            let earliest = self
                .lock()
                .values()
                .map(|l| l.info.expires_unix_ms)
                .min()
                .map(|e| Duration::from_millis(e.saturating_sub(now).max(1)))
                .unwrap_or(Duration::from_secs(1));
            return Err(Error::Busy {
                reason: format!("no lease of {slots} slots now: {why}"),
                retry_after: earliest,
            });
        }
        let info = LeaseInfo {
            id: csd_protocol::refs::new_group(),
            tenant,
            slots,
            expires_unix_ms: now_unix_ms().saturating_add(ttl.as_millis() as u64),
            idle_ms: idle.map(|d| (d.as_millis() as u64).max(1)),
            memory,
        };
        self.lock().insert(
            info.id.clone(),
            Arc::new(Lease {
                info: info.clone(),
                seen: AtomicU64::new(now_unix_ms()),
                hot: std::sync::Mutex::new(HashMap::new()),
                cancel: Arc::new(AtomicBool::new(false)),
                running: Arc::new(tokio::sync::Semaphore::new(slots)),
                memory_used: AtomicU64::new(0),
                bucket,
                _quota: quota,
            }),
        );
        self.granted.fetch_add(1, Ordering::Relaxed);
        Ok(info)
    }

    /// A slot to run an operator request needing `memory` bytes on, from the first
    /// of `ids` (a `csd-lease` header's) this node holds, for `tenant` (`None`: an
    /// admin): waits for one of the lease's slots. `None` when the node holds none
    /// of them or the request does not fit the lease's memory (or the node's free
    /// memory): it goes through admission then.
    pub async fn run_on(
        &self,
        admission: &Arc<Admission>,
        ids: &LeaseIds,
        tenant: Option<&str>,
        memory: u64,
    ) -> Result<Option<LeaseRun>> {
        let mut held = None;
        for id in ids.iter() {
            match self.get(id, tenant) {
                Ok(l) => {
                    held = Some(l);
                    break;
                }
                Err(Error::NotFound(_)) => {}
                Err(e) => return Err(e),
            }
        }
        let Some(l) = held else { return Ok(None) };
        let waiting = std::time::Instant::now();
        let permit = Self::acquire(&l).await?;
        let waited = waiting.elapsed();
        let memory = if l.info.memory > 0 {
            let fits = l
                .memory_used
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                    (used.saturating_add(memory) <= l.info.memory).then_some(used + memory)
                })
                .is_ok();
            if !fits {
                return Ok(None);
            }
            Held::Lease(memory)
        } else if admission.take_memory(memory) {
            Held::Node(admission.clone(), memory)
        } else {
            return Ok(None);
        };
        self.runs.fetch_add(1, Ordering::Relaxed);
        Ok(Some(LeaseRun {
            lease: l,
            _permit: permit,
            memory,
            waited,
        }))
    }

    /// One of lease `l`'s slots, waiting for one.
    async fn acquire(l: &Lease) -> Result<tokio::sync::OwnedSemaphorePermit> {
        l.running.clone().acquire_owned().await.map_err(|_| {
            Error::NotFound(format!(
                "lease {} ended while the call waited",
                truncated(&l.info.id)
            ))
        })
    }

    fn get(&self, id: &str, tenant: Option<&str>) -> Result<Arc<Lease>> {
        let now = now_unix_ms();
        let l = self
            .lock()
            .get(id)
            .cloned()
            .filter(|l| !l.over(now))
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "lease {} is not held here: it expired, was released, or never existed",
                    truncated(id)
                ))
            })?;
        match tenant {
            Some(t) if t != l.info.tenant => Err(Error::PermissionDenied(format!(
                "lease {} belongs to tenant {}, not to {}",
                truncated(id),
                truncated(&l.info.tenant),
                truncated(t)
            ))),
            _ => {
                l.seen.store(now, Ordering::Relaxed);
                Ok(l)
            }
        }
    }

    /// A slot of lease `id` to run one call on (for `tenant`; `None`: an admin):
    /// calls beyond the lease's slots wait for one, so a lease never uses more
    /// cores than it holds.
    pub async fn slot(
        &self,
        id: &str,
        tenant: Option<&str>,
    ) -> Result<tokio::sync::OwnedSemaphorePermit> {
        Self::acquire(&*self.get(id, tenant)?).await
    }

    /// Notes that lease `id`'s holder is alive (for `tenant`; `None`: an admin).
    pub fn touch(&self, id: &str, tenant: Option<&str>) -> Result<LeaseInfo> {
        Ok(self.get(id, tenant)?.info.clone())
    }

    /// Ends lease `id` now (for `tenant`; `None`: an admin); its slots come back.
    pub fn release(
        &self,
        admission: &Admission,
        id: &str,
        tenant: Option<&str>,
    ) -> Result<LeaseInfo> {
        let l = self.get(id, tenant)?;
        self.end(admission, &l);
        Ok(l.info.clone())
    }

    fn end(&self, admission: &Admission, l: &Lease) {
        if self.lock().remove(&l.info.id).is_some() {
            l.cancel.store(true, Ordering::Relaxed);
            l.running.close();
            admission.unlease(&l.bucket, l.info.slots, l.info.memory);
        }
    }

    /// Ends every expired lease; returns how many.
    pub fn sweep(&self, admission: &Admission) -> usize {
        let now = now_unix_ms();
        let expired: Vec<Arc<Lease>> = self
            .lock()
            .values()
            .filter(|l| l.over(now))
            .cloned()
            .collect();
        for l in &expired {
            self.end(admission, l);
        }
        self.expired
            .fetch_add(expired.len() as u64, Ordering::Relaxed);
        expired.len()
    }

    /// `tenant`'s leases (`None`: all).
    pub fn list(&self, tenant: Option<&str>) -> Vec<LeaseInfo> {
        self.lock()
            .values()
            .filter(|l| tenant.is_none_or(|t| t == l.info.tenant))
            .map(|l| l.info.clone())
            .collect()
    }

    /// Calls `export` of module `digest` on `args` on lease `id` (for `tenant`;
    /// `None`: an admin): on the instance the lease keeps for the module, or a new
    /// one. Runs on the caller's thread (the lease's slot), not through admission.
    pub fn invoke(
        &self,
        sandbox: &Arc<Sandbox>,
        module: &Arc<crate::sandbox::CompiledModule>,
        id: &str,
        tenant: Option<&str>,
        export: &str,
        args: &arrow::record_batch::RecordBatch,
    ) -> Result<(arrow::array::ArrayRef, Start)> {
        let l = self.get(id, tenant)?;
        let kept = l
            .hot
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&module.digest);
        let (mut instance, start) = match kept {
            Some(i) => (i, Start::Hot),
            None => (
                sandbox.instantiate_functions(module, l.cancel.clone())?,
                Start::Warm,
            ),
        };
        let out = instance.call_function(export, args)?;
        // Kept for the next call unless the lease ended meanwhile.
        if !l.cancel.load(Ordering::Relaxed) {
            l.hot
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(module.digest, instance);
        }
        Ok((out, start))
    }

    /// Figures for `stats`.
    pub fn stats(&self) -> LeaseStats {
        let leases = self.lock();
        LeaseStats {
            live: leases.len() as u64,
            slots: leases.values().map(|l| l.info.slots as u64).sum(),
            granted: self.granted.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            expired: self.expired.load(Ordering::Relaxed),
            runs: self.runs.load(Ordering::Relaxed),
        }
    }
}
