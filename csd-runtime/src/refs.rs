//! Results kept by reference: an operator request may ask the node to keep its
//! answer instead of streaming it (ProxyStore's idea: hand out a small reference and
//! let whoever needs the data resolve it, just in time, from where it lies).
//!
//! A kept result is a partition of a hidden table the node writes with its usual
//! Parquet encoding: table `csd_ref_GROUP` (one group per kept query, so a query
//! kept over several partitions and nodes is one table again), partition `ID`, with
//! a JSON record beside it (`.csd/refs/ID.json`: owner, table, expiry, size). Being
//! a table, a kept result is also the input of the next query at the node
//! (`SELECT … FROM csd_ref_GROUP`): a pipeline of steps moves only its last answer.
//! Only the tenant that kept it may read that table (and an admin); nobody writes
//! it. Both live on the device, so after a restart (even `kill -9`) unexpired
//! references still resolve and expired ones are freed. A reference is a Flight ticket (`Ticket::Ref`, sealed for its tenant when
//! the node has tenants) in a `FlightEndpoint` whose `expiration_time` is the
//! reference's: `DoGet` streams it, `RenewFlightEndpoint` extends it,
//! `CancelFlightInfo` (or the `release` action) frees it, and the node frees it by
//! itself when it expires. Its bytes count against its tenant's `max_stored_bytes`.
//!
//! The tenant that kept a result may **grant** it to other tenants (the `grant`
//! action): a grant covers the whole kept query at this node (every reference of its
//! group), lets the grantee resolve it and read its table in the next query, with a
//! ticket sealed for the grantee, and is taken back the same way. Only the owner
//! renews, releases or grants.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;

use crate::error::{Error, Result, truncated};
use crate::store::ObjectStore;
use crate::table::TableStore;
pub use csd_protocol::refs::{
    RefInfo, Reference, check_group, decode_ticket, new_group, now_unix_ms, rfc3339, timestamp,
};
pub use csd_protocol::stats::RefStats;

/// Where the records of kept results live on the device.
pub const REF_PREFIX: &str = ".csd/refs/";
/// The tables kept results are partitions of: `csd_ref_GROUP`.
pub const REF_TABLE_PREFIX: &str = "csd_ref_";

/// Whether `table` is a kept results' table.
pub fn is_ref_table(table: &str) -> bool {
    table.starts_with(REF_TABLE_PREFIX)
}

fn record_name(id: &str) -> String {
    format!("{REF_PREFIX}{id}.json")
}

/// The kept results of a node.
pub struct RefStore {
    store: ObjectStore,
    refs: std::sync::Mutex<HashMap<String, RefInfo>>,
    /// Longest lifetime a reference may be given (keep or renew).
    pub max_ttl: Duration,
    freed_expired: AtomicU64,
}

/// What keeping a result produced.
pub struct Kept {
    /// The reference.
    pub info: RefInfo,
    /// The result's schema.
    pub schema: arrow::datatypes::SchemaRef,
    /// The operator's trailing report (`app_metadata`), if it sent one.
    pub report: Option<Bytes>,
}

impl RefStore {
    /// The references kept on `tables`' store: unexpired ones are loaded, expired
    /// ones and the leftovers of a keep that never finished are freed.
    pub async fn open(tables: &TableStore, max_ttl: Duration) -> Result<Arc<Self>> {
        let store = tables.object_store().clone();
        let now = now_unix_ms();
        let mut refs = HashMap::new();
        let mut doomed: Vec<RefInfo> = Vec::new();
        for o in store.list(REF_PREFIX) {
            let Some(id) = o
                .name
                .strip_prefix(REF_PREFIX)
                .and_then(|n| n.strip_suffix(".json"))
            else {
                continue;
            };
            let record = match store.get_all(&o.name).await {
                Ok(r) => r,
                // A damaged record: the result is freed (its partition becomes an
                // orphan, freed below) rather than the node refusing to start.
                Err(e @ Error::Corrupt(_)) => {
                    tracing::warn!("freeing kept result {id}: its record is damaged ({e})");
                    let _ = store.delete(&o.name).await;
                    continue;
                }
                Err(e) => return Err(e),
            };
            match serde_json::from_slice::<RefInfo>(&record) {
                Ok(r) if r.id == id && is_ref_table(&r.table) => {
                    let there = tables
                        .table(&r.table)
                        .is_ok_and(|t| t.partitions.contains_key(&r.id));
                    if there && !r.expired_at(now) {
                        refs.insert(r.id.clone(), r);
                    } else {
                        doomed.push(r);
                    }
                }
                Ok(_) | Err(_) => {
                    tracing::warn!("freeing kept result {id}: its record does not parse");
                    let _ = store.delete(&o.name).await;
                }
            }
        }
        // Partitions without a record: a keep cut short (crash) before it was recorded.
        for t in tables.tables().iter().filter(|t| is_ref_table(&t.name)) {
            for p in t.partitions.keys() {
                if !refs.contains_key(p) && !doomed.iter().any(|d| &d.id == p) {
                    doomed.push(RefInfo {
                        id: p.clone(),
                        tenant: String::new(),
                        operator: String::new(),
                        table: t.name.clone(),
                        created_unix_ms: 0,
                        expires_unix_ms: 0,
                        rows: 0,
                        bytes: 0,
                        readers: Vec::new(),
                    });
                }
            }
        }
        let me = Arc::new(RefStore {
            store,
            refs: std::sync::Mutex::new(refs),
            max_ttl,
            freed_expired: AtomicU64::new(0),
        });
        for r in doomed {
            me.free(tables, &r).await;
        }
        Ok(me)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, RefInfo>> {
        self.refs.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn free(&self, tables: &TableStore, r: &RefInfo) {
        // The record first: once it is gone, the partition is an orphan a restart frees.
        if let Err(e) = self.store.delete(&record_name(&r.id)).await
            && !matches!(e, Error::NotFound(_))
        {
            tracing::warn!("freeing kept result {}: {e}", r.id);
        }
        if let Err(e) = tables.delete(&r.table, Some(&r.id), &[]).await
            && !matches!(e, Error::NotFound(_))
        {
            tracing::warn!("freeing kept result {}: {e}", r.id);
        }
    }

    async fn write_record(&self, r: &RefInfo) -> Result<()> {
        let json = serde_json::to_vec(r).map_err(|e| Error::Internal(e.to_string()))?;
        self.store.put(&record_name(&r.id), &json).await?;
        Ok(())
    }

    /// The lifetime asked for, checked against [`Self::max_ttl`].
    pub fn check_ttl(&self, ttl: Duration) -> Result<Duration> {
        if ttl.is_zero() {
            return Err(Error::InvalidArgument(
                "a kept result needs a lifetime above zero".into(),
            ));
        }
        if ttl > self.max_ttl {
            return Err(Error::InvalidArgument(format!(
                "a kept result may live at most {} s on this node (--ref-max-ttl); {} s was asked",
                self.max_ttl.as_secs(),
                ttl.as_secs()
            )));
        }
        Ok(ttl)
    }

    /// Stores `batches` (an operator's answer, of `schema`) as a new kept result of
    /// `tenant` living `ttl`: partition `ID` of table `csd_ref_GROUP` (`group`, or a
    /// new one). A group belongs to the tenant that made it. `room` is how many
    /// bytes it may take (its tenant's quota left); past it nothing is kept and the
    /// call is `RESOURCE_EXHAUSTED`. Writing it takes at most `memory` bytes (what
    /// its caller holds of the node's budget).
    #[allow(clippy::too_many_arguments)]
    pub async fn keep<S>(
        &self,
        tables: &TableStore,
        tenant: &str,
        operator: &str,
        group: Option<&str>,
        ttl: Duration,
        room: Option<u64>,
        memory: u64,
        schema: arrow::datatypes::SchemaRef,
        batches: S,
    ) -> Result<RefInfo>
    where
        S: Stream<Item = Result<arrow::record_batch::RecordBatch>> + Unpin + Send,
    {
        let ttl = self.check_ttl(ttl)?;
        let group = match group {
            Some(g) => {
                check_group(g)?;
                g.to_string()
            }
            None => new_group(),
        };
        let table = format!("{REF_TABLE_PREFIX}{group}");
        self.check_group_table(&table, Some(tenant), true)
            .or_else(|e| match e {
                Error::NotFound(_) => Ok(()),
                e => Err(e),
            })?;
        let id = new_group();
        let put = tables
            .append_transient(&table, &id, schema, batches, memory)
            .await?;
        let now = now_unix_ms();
        let info = RefInfo {
            id: id.clone(),
            tenant: tenant.to_string(),
            operator: operator.to_string(),
            table,
            created_unix_ms: now,
            expires_unix_ms: now.saturating_add(ttl.as_millis() as u64),
            rows: put.rows,
            bytes: put.bytes,
            readers: Vec::new(),
        };
        if let Some(room) = room
            && put.bytes > room
        {
            self.free(tables, &info).await;
            return Err(Error::ResourcesExhausted(format!(
                "keeping this result takes {} bytes, more than the {room} left in tenant {}'s max_stored_bytes quota; nothing was kept",
                put.bytes,
                truncated(tenant)
            )));
        }
        if let Err(e) = self.write_record(&info).await {
            self.free(tables, &info).await;
            return Err(e);
        }
        self.lock().insert(id, info.clone());
        Ok(info)
    }

    /// `Ok` if `tenant` (`None`: an admin) may read kept results' table `table`: it
    /// owns the live references of that table or they were granted to it;
    /// `NOT_FOUND` when the table holds none.
    pub fn check_table(&self, table: &str, tenant: Option<&str>) -> Result<()> {
        self.check_group_table(table, tenant, false)
    }

    /// [`Self::check_table`]; `owner_only`: grantees do not pass (adding to a group).
    fn check_group_table(&self, table: &str, tenant: Option<&str>, owner_only: bool) -> Result<()> {
        let now = now_unix_ms();
        let refs = self.lock();
        let live: Vec<&RefInfo> = refs
            .values()
            .filter(|r| r.table == table && !r.expired_at(now))
            .collect();
        let Some(first) = live.first() else {
            return Err(Error::NotFound(format!(
                "table {}: no kept results of that name (they expired, were released, or never existed)",
                truncated(table)
            )));
        };
        match tenant {
            Some(t)
                if !live
                    .iter()
                    .all(|r| r.tenant == t || (!owner_only && r.readable_by(t))) =>
            {
                Err(Error::PermissionDenied(format!(
                    "kept results {} belong to tenant {}, not to {}{}",
                    truncated(table),
                    truncated(&first.tenant),
                    truncated(t),
                    if owner_only {
                        ""
                    } else {
                        ", and were not granted to it"
                    }
                )))
            }
            _ => Ok(()),
        }
    }

    /// The live reference `id` owned by `tenant` (`None`: any tenant, an admin):
    /// what renewing, releasing and granting need.
    pub fn get(&self, id: &str, tenant: Option<&str>) -> Result<RefInfo> {
        self.lookup(id, tenant, false)
    }

    /// The live reference `id` if `tenant` (`None`: an admin) may read it: its
    /// owner or a grantee.
    pub fn get_readable(&self, id: &str, tenant: Option<&str>) -> Result<RefInfo> {
        self.lookup(id, tenant, true)
    }

    fn lookup(&self, id: &str, tenant: Option<&str>, reading: bool) -> Result<RefInfo> {
        let gone = || {
            Error::NotFound(format!(
                "reference {} is not kept here: it expired, was released, or never existed",
                truncated(id)
            ))
        };
        let r = self.lock().get(id).cloned().ok_or_else(gone)?;
        if r.expired_at(now_unix_ms()) {
            return Err(gone());
        }
        match tenant {
            Some(t) if t != r.tenant && !(reading && r.readable_by(t)) => {
                Err(Error::PermissionDenied(format!(
                    "reference {} belongs to tenant {}, not to {}{}",
                    truncated(id),
                    truncated(&r.tenant),
                    truncated(t),
                    if r.readable_by(t) {
                        " (it was granted to read, not to renew, free or grant)"
                    } else {
                        ""
                    }
                )))
            }
            _ => Ok(r),
        }
    }

    /// Grants (or with `revoke`, takes back) reading the kept query that reference
    /// `id` belongs to — every live reference of its group here — to tenant `to`;
    /// for `tenant`, its owner (`None`: an admin). Returns the reference `id` as it
    /// now is.
    pub async fn grant(
        &self,
        id: &str,
        tenant: Option<&str>,
        to: &str,
        revoke: bool,
    ) -> Result<RefInfo> {
        let r = self.get(id, tenant)?;
        if to.is_empty() || to == r.tenant {
            return Err(Error::InvalidArgument(format!(
                "a kept result is granted to another tenant, not to {:?} (its owner)",
                truncated(to)
            )));
        }
        let now = now_unix_ms();
        let group: Vec<RefInfo> = self
            .lock()
            .values()
            .filter(|g| g.table == r.table && !g.expired_at(now))
            .cloned()
            .collect();
        let mut out = r;
        for mut g in group {
            // A change only when it is not already as asked.
            if g.readers.iter().any(|x| x == to) == revoke {
                if revoke {
                    g.readers.retain(|x| x != to);
                } else {
                    g.readers.push(to.to_string());
                }
                self.write_record(&g).await?;
                self.lock().insert(g.id.clone(), g.clone());
            }
            if g.id == id {
                out = g;
            }
        }
        Ok(out)
    }

    /// Sets reference `id`'s expiry (for `tenant`; `None`: an admin) to `expires`
    /// (milliseconds since the Unix epoch), at most [`Self::max_ttl`] from now.
    pub async fn renew(&self, id: &str, tenant: Option<&str>, expires: u64) -> Result<RefInfo> {
        let mut r = self.get(id, tenant)?;
        let now = now_unix_ms();
        if expires <= now {
            return Err(Error::InvalidArgument(
                "the expiration time asked for is in the past".into(),
            ));
        }
        self.check_ttl(Duration::from_millis(expires - now))?;
        r.expires_unix_ms = expires;
        self.write_record(&r).await?;
        self.lock().insert(r.id.clone(), r.clone());
        Ok(r)
    }

    /// Frees reference `id` now (for `tenant`; `None`: an admin).
    pub async fn release(
        &self,
        tables: &TableStore,
        id: &str,
        tenant: Option<&str>,
    ) -> Result<RefInfo> {
        let r = self.get(id, tenant)?;
        self.lock().remove(id);
        self.free(tables, &r).await;
        Ok(r)
    }

    /// The live references `tenant` may read, its own and those granted to it
    /// (`None`: all).
    pub fn list(&self, tenant: Option<&str>) -> Vec<RefInfo> {
        let now = now_unix_ms();
        let mut v: Vec<RefInfo> = self
            .lock()
            .values()
            .filter(|r| !r.expired_at(now) && tenant.is_none_or(|t| r.readable_by(t)))
            .cloned()
            .collect();
        v.sort_by_key(|r| r.created_unix_ms);
        v
    }

    /// Bytes `tenant`'s references take.
    pub fn bytes_of(&self, tenant: &str) -> u64 {
        self.lock()
            .values()
            .filter(|r| r.tenant == tenant)
            .map(|r| r.bytes)
            .sum()
    }

    /// Frees every expired reference; returns how many.
    pub async fn sweep(&self, tables: &TableStore) -> usize {
        let now = now_unix_ms();
        let expired: Vec<RefInfo> = {
            let mut refs = self.lock();
            let ids: Vec<String> = refs
                .values()
                .filter(|r| r.expired_at(now))
                .map(|r| r.id.clone())
                .collect();
            ids.iter().filter_map(|id| refs.remove(id)).collect()
        };
        for r in &expired {
            self.free(tables, r).await;
        }
        self.freed_expired
            .fetch_add(expired.len() as u64, Ordering::Relaxed);
        expired.len()
    }

    /// Figures for `stats`.
    pub fn stats(&self) -> RefStats {
        let refs = self.lock();
        RefStats {
            live: refs.len() as u64,
            bytes: refs.values().map(|r| r.bytes).sum(),
            freed_expired: self.freed_expired.load(Ordering::Relaxed),
        }
    }
}
