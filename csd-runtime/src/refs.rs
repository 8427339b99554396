//! Results kept by reference: an operator request may ask the node to keep its
//! answer instead of streaming it (ProxyStore's idea: hand out a small reference and
//! let whoever needs the data resolve it, just in time, from where it lies).
//!
//! A kept result is an Arrow IPC stream the node writes as its own object
//! (`.csd/refs/ID.arrows`, never served raw) with a JSON record beside it
//! (`.csd/refs/ID.json`: owner, expiry, size). Both live on the device, so after a
//! restart (even `kill -9`) unexpired references still resolve and expired ones are
//! freed. A reference is a Flight ticket (`Ticket::Ref`, sealed for its tenant when
//! the node has tenants) in a `FlightEndpoint` whose `expiration_time` is the
//! reference's: `DoGet` streams it, `RenewFlightEndpoint` extends it,
//! `CancelFlightInfo` (or the `release` action) frees it, and the node frees it by
//! itself when it expires. Its bytes count against its tenant's `max_stored_bytes`.
//!
//! The IPC stream is written message by message as the operator's encoder made
//! them (no decode, no re-encode), and read back the same way.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arrow_flight::FlightData;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use tonic::Status;

use crate::error::{Error, Result, truncated};
use crate::store::{ObjectInfo, ObjectStore};

/// Where kept results live on the device.
pub const REF_PREFIX: &str = ".csd/refs/";

/// A kept result: what the node records of it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RefInfo {
    /// 32 hex digits, random: unguessable.
    pub id: String,
    /// The tenant that kept it (empty on a node without tenants).
    pub tenant: String,
    /// The operator that made it (`sql`, `wasm`, …).
    pub operator: String,
    /// Milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// When the node frees it, milliseconds since the Unix epoch.
    pub expires_unix_ms: u64,
    /// Rows in it.
    pub rows: u64,
    /// Bytes it takes on the device.
    pub bytes: u64,
}

impl RefInfo {
    /// Whether it has expired at `now_ms`.
    pub fn expired_at(&self, now_ms: u64) -> bool {
        now_ms >= self.expires_unix_ms
    }
}

/// Milliseconds since the Unix epoch, now.
pub fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn data_name(id: &str) -> String {
    format!("{REF_PREFIX}{id}.arrows")
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
    /// The IPC-encoded schema message of the result (for `FlightInfo.schema`).
    pub schema: Option<arrow::datatypes::Schema>,
    /// The operator's trailing report (`app_metadata`), if it sent one.
    pub report: Option<Bytes>,
}

impl RefStore {
    /// The references kept on `store`: unexpired ones are loaded, expired ones and
    /// the leftovers of a keep that never finished are freed.
    pub async fn open(store: ObjectStore, max_ttl: Duration) -> Result<Arc<Self>> {
        let now = now_unix_ms();
        let mut refs = HashMap::new();
        let mut doomed = Vec::new();
        let objects = store.list(REF_PREFIX);
        for o in &objects {
            let Some(id) = o
                .name
                .strip_prefix(REF_PREFIX)
                .and_then(|n| n.strip_suffix(".json"))
            else {
                continue;
            };
            let record = store.get_all(&o.name).await?;
            match serde_json::from_slice::<RefInfo>(&record) {
                Ok(r)
                    if r.id == id && !r.expired_at(now) && store.get(&data_name(id)).is_some() =>
                {
                    refs.insert(r.id.clone(), r);
                }
                Ok(_) => doomed.push(id.to_string()),
                Err(e) => {
                    tracing::warn!("freeing reference {id}: its record does not parse: {e}");
                    doomed.push(id.to_string());
                }
            }
        }
        // Data without a record: a keep cut short (crash) before it was recorded.
        for o in &objects {
            if let Some(id) = o
                .name
                .strip_prefix(REF_PREFIX)
                .and_then(|n| n.strip_suffix(".arrows"))
                && !refs.contains_key(id)
                && !doomed.iter().any(|d| d == id)
            {
                doomed.push(id.to_string());
            }
        }
        let me = Arc::new(RefStore {
            store,
            refs: std::sync::Mutex::new(refs),
            max_ttl,
            freed_expired: AtomicU64::new(0),
        });
        for id in doomed {
            me.free_objects(&id).await;
        }
        Ok(me)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, RefInfo>> {
        self.refs.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn free_objects(&self, id: &str) {
        // The record first: once it is gone, the data is an orphan a restart frees.
        for name in [record_name(id), data_name(id)] {
            if let Err(e) = self.store.delete(&name).await
                && !matches!(e, Error::NotFound(_))
            {
                tracing::warn!("freeing {name}: {e}");
            }
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

    /// Writes `answer` (an operator's encoded answer: schema, batches, then a
    /// trailing report with only `app_metadata`) as a new reference of `tenant`
    /// living `ttl`. `room` is how many bytes it may take (its tenant's quota left);
    /// past it nothing is kept and the call is `RESOURCE_EXHAUSTED`.
    pub async fn keep<S>(
        &self,
        tenant: &str,
        operator: &str,
        ttl: Duration,
        room: Option<u64>,
        mut answer: S,
    ) -> Result<Kept>
    where
        S: Stream<Item = std::result::Result<FlightData, Status>> + Unpin,
    {
        let ttl = self.check_ttl(ttl)?;
        let id = crate::auth::hex(&rand::random::<[u8; 16]>());
        let mut w = self.store.create(&data_name(&id))?;
        let (mut schema, mut report, mut rows) = (None, None, 0u64);
        const PAD: [u8; 8] = [0; 8];
        while let Some(d) = answer.next().await {
            let d = d.map_err(status_error)?;
            if d.data_header.is_empty() {
                if !d.app_metadata.is_empty() {
                    report = Some(d.app_metadata.clone());
                }
                continue;
            }
            let message = arrow::ipc::root_as_message(&d.data_header).map_err(|e| {
                Error::Internal(format!("an operator's answer is not Arrow IPC: {e}"))
            })?;
            match message.header_type() {
                arrow::ipc::MessageHeader::Schema if schema.is_none() => {
                    schema = message
                        .header_as_schema()
                        .map(arrow::ipc::convert::fb_to_schema);
                }
                arrow::ipc::MessageHeader::RecordBatch => {
                    rows += message
                        .header_as_record_batch()
                        .map(|b| b.length() as u64)
                        .unwrap_or(0);
                }
                _ => {}
            }
            let padded = d.data_header.len().div_ceil(8) * 8;
            let len = u32::try_from(padded)
                .map_err(|_| Error::Internal("an IPC message header over 4 GiB".into()))?;
            w.write(&0xFFFF_FFFFu32.to_le_bytes()).await?;
            w.write(&len.to_le_bytes()).await?;
            w.write(&d.data_header).await?;
            w.write(&PAD[..padded - d.data_header.len()]).await?;
            w.write(&d.data_body).await?;
            if let Some(room) = room
                && w.len() > room
            {
                return Err(Error::ResourcesExhausted(format!(
                    "keeping this result would take more than the {room} bytes left in tenant {}'s max_stored_bytes quota; nothing was kept",
                    truncated(tenant)
                )));
            }
        }
        // End of stream.
        w.write(&0xFFFF_FFFFu32.to_le_bytes()).await?;
        w.write(&0u32.to_le_bytes()).await?;
        let object = w.finish().await?;
        let now = now_unix_ms();
        let info = RefInfo {
            id: id.clone(),
            tenant: tenant.to_string(),
            operator: operator.to_string(),
            created_unix_ms: now,
            expires_unix_ms: now.saturating_add(ttl.as_millis() as u64),
            rows,
            bytes: object.len,
        };
        if let Err(e) = self.write_record(&info).await {
            self.free_objects(&id).await;
            return Err(e);
        }
        self.lock().insert(id, info.clone());
        Ok(Kept {
            info,
            schema,
            report,
        })
    }

    /// The live reference `id` for `tenant` (`None`: any tenant, an admin).
    pub fn get(&self, id: &str, tenant: Option<&str>) -> Result<RefInfo> {
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
        if let Some(t) = tenant
            && t != r.tenant
        {
            return Err(Error::PermissionDenied(format!(
                "reference {} belongs to tenant {}, not to {}",
                truncated(id),
                truncated(&r.tenant),
                truncated(t)
            )));
        }
        Ok(r)
    }

    /// Streams reference `r` back as the `FlightData` messages it was kept as.
    pub fn stream(&self, r: &RefInfo) -> Result<BoxStream<'static, Result<FlightData>>> {
        let object = self.store.get(&data_name(&r.id)).ok_or_else(|| {
            Error::NotFound(format!("reference {}'s data is gone", truncated(&r.id)))
        })?;
        let store = self.store.clone();
        Ok(futures::stream::try_unfold(0u64, move |at| {
            let (store, object) = (store.clone(), object.clone());
            async move { next_message(&store, &object, at).await }
        })
        .boxed())
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
    pub async fn release(&self, id: &str, tenant: Option<&str>) -> Result<RefInfo> {
        let r = self.get(id, tenant)?;
        self.lock().remove(id);
        self.free_objects(id).await;
        Ok(r)
    }

    /// The live references of `tenant` (`None`: all).
    pub fn list(&self, tenant: Option<&str>) -> Vec<RefInfo> {
        let now = now_unix_ms();
        let mut v: Vec<RefInfo> = self
            .lock()
            .values()
            .filter(|r| !r.expired_at(now) && tenant.is_none_or(|t| t == r.tenant))
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
    pub async fn sweep(&self) -> usize {
        let now = now_unix_ms();
        let expired: Vec<String> = {
            let mut refs = self.lock();
            let ids: Vec<String> = refs
                .values()
                .filter(|r| r.expired_at(now))
                .map(|r| r.id.clone())
                .collect();
            for id in &ids {
                refs.remove(id);
            }
            ids
        };
        for id in &expired {
            self.free_objects(id).await;
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

/// Kept results, in `stats`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct RefStats {
    /// References kept now.
    pub live: u64,
    /// Bytes they take.
    pub bytes: u64,
    /// References freed because they expired, since start.
    pub freed_expired: u64,
}

/// The message at `at` of a kept stream, and where the next one starts.
async fn next_message(
    store: &ObjectStore,
    object: &Arc<ObjectInfo>,
    at: u64,
) -> Result<Option<(FlightData, u64)>> {
    let damaged = |what: &str| {
        Error::Corrupt(format!(
            "kept result {} is damaged at byte {at}: {what}",
            truncated(&object.name)
        ))
    };
    if at + 8 > object.len {
        return Err(damaged("it ends without an end-of-stream marker"));
    }
    let prefix = store.read_object_range(object, at, 8).await?;
    let marker = u32::from_le_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]);
    let len = u32::from_le_bytes([prefix[4], prefix[5], prefix[6], prefix[7]]) as u64;
    if marker != 0xFFFF_FFFF {
        return Err(damaged("no continuation marker"));
    }
    if len == 0 {
        return Ok(None);
    }
    if at + 8 + len > object.len {
        return Err(damaged("a message runs past its end"));
    }
    let header = store.read_object_range(object, at + 8, len).await?;
    let body_len = {
        let m = arrow::ipc::root_as_message(&header).map_err(|e| damaged(&e.to_string()))?;
        u64::try_from(m.bodyLength()).map_err(|_| damaged("a negative body length"))?
    };
    let body_at = at + 8 + len;
    if body_at + body_len > object.len {
        return Err(damaged("a message body runs past its end"));
    }
    let body = if body_len == 0 {
        Bytes::new()
    } else {
        store.read_object_range(object, body_at, body_len).await?
    };
    Ok(Some((
        FlightData {
            data_header: header,
            data_body: body,
            ..Default::default()
        },
        body_at + body_len,
    )))
}

/// An error the operator's stream carried, back as the node's error.
fn status_error(s: Status) -> Error {
    use tonic::Code;
    let m = s.message().to_string();
    match s.code() {
        Code::InvalidArgument => Error::InvalidArgument(m),
        Code::NotFound => Error::NotFound(m),
        Code::PermissionDenied => Error::PermissionDenied(m),
        Code::ResourceExhausted => Error::ResourcesExhausted(m),
        Code::DeadlineExceeded => Error::DeadlineExceeded(m),
        Code::Cancelled => Error::Cancelled(m),
        Code::DataLoss => Error::Corrupt(m),
        Code::Unavailable => Error::Unavailable(m),
        _ => Error::Internal(m),
    }
}

/// Frees expired references every `period` while the store lives.
pub async fn sweep_every(refs: std::sync::Weak<RefStore>, period: Duration) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(refs) = refs.upgrade() else { return };
        let n = refs.sweep().await;
        if n > 0 {
            tracing::info!(freed = n, "expired references freed");
        }
    }
}

/// A kept result as a client holds it and prints it (one JSON object per endpoint):
/// `{"location": "grpc://host:port", "ticket": "<base64>", "expires": "<RFC 3339>"}`.
/// Any Flight client resolves it with a plain `DoGet` of the ticket at the location.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Reference {
    /// The node holding it.
    pub location: String,
    /// Its Flight ticket, base64 (standard alphabet, padded).
    pub ticket: String,
    /// When the node frees it (RFC 3339, UTC).
    pub expires: String,
}

impl Reference {
    /// From a kept result's endpoint; `default_location` when it names none.
    pub fn of_endpoint(e: &arrow_flight::FlightEndpoint, default_location: &str) -> Result<Self> {
        use base64::Engine as _;
        let ticket = e
            .ticket
            .as_ref()
            .ok_or_else(|| Error::Internal("a kept result's endpoint has no ticket".into()))?;
        let expires = e
            .expiration_time
            .as_ref()
            .map(|t| {
                chrono::DateTime::from_timestamp(t.seconds, t.nanos.max(0) as u32)
                    .unwrap_or_default()
                    .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
            })
            .unwrap_or_default();
        Ok(Reference {
            location: e
                .location
                .first()
                .map(|l| l.uri.clone())
                .unwrap_or_else(|| default_location.to_string()),
            ticket: base64::engine::general_purpose::STANDARD.encode(&ticket.ticket),
            expires,
        })
    }

    /// Parses one reference as printed (JSON); a bad one is `INVALID_ARGUMENT` saying
    /// what a reference looks like.
    pub fn parse(text: &str) -> Result<Self> {
        serde_json::from_str(text.trim()).map_err(|e| {
            Error::InvalidArgument(format!(
                "not a reference ({e}): expected {{\"location\": \"grpc://host:port\", \"ticket\": \"<base64>\", \"expires\": \"<RFC 3339>\"}}"
            ))
        })
    }

    /// The ticket's bytes.
    pub fn ticket_bytes(&self) -> Result<Vec<u8>> {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD
            .decode(self.ticket.trim())
            .map_err(|e| {
                Error::InvalidArgument(format!("the reference's ticket is not base64: {e}"))
            })
    }

    /// When it expires, milliseconds since the Unix epoch (0 when not given).
    pub fn expires_unix_ms(&self) -> u64 {
        chrono::DateTime::parse_from_rfc3339(&self.expires)
            .map(|t| t.timestamp_millis().max(0) as u64)
            .unwrap_or(0)
    }

    /// As a Flight endpoint (to renew or cancel it with any Flight client).
    pub fn endpoint(&self) -> Result<arrow_flight::FlightEndpoint> {
        let ms = self.expires_unix_ms();
        let mut e = arrow_flight::FlightEndpoint::new()
            .with_ticket(arrow_flight::Ticket::new(self.ticket_bytes()?))
            .with_location(self.location.clone());
        if ms > 0 {
            e = e.with_expiration_time(prost_types::Timestamp {
                seconds: (ms / 1000) as i64,
                nanos: ((ms % 1000) * 1_000_000) as i32,
            });
        }
        Ok(e)
    }
}
