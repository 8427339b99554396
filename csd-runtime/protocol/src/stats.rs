//! The node's figures as the `stats` action answers them ([`NodeStats`]) and every
//! part of them: admission, device, object store, shipped code, kept results,
//! leases. They are messages of the protocol: the node fills them, any client reads
//! them, and nothing here depends on how the node computes them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Node figures (`DoAction stats`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeStats {
    /// Advertised location.
    pub location: String,
    /// Seconds since start.
    pub uptime_s: f64,
    /// CPU pool size.
    pub cpus: usize,
    /// Memory budget in bytes.
    pub memory_budget: u64,
    /// Admission control: decisions, queueing delay, learned costs, tenants.
    pub admission: AdmissionStats,
    /// Memory held by running operator requests now.
    pub operator_memory_used: u64,
    /// What operators' working memory may reach now: the budget less what the
    /// process holds besides (decode and network buffers, catalog, allocator slack),
    /// never under an eighth of the budget.
    #[serde(default)]
    pub operator_memory_limit: u64,
    /// The node process's resident memory now (`/proc/self/statm`), to hold against
    /// [`memory_budget`](Self::memory_budget): the budget counts operators' working
    /// memory; this also counts decode buffers, the device's caches, the allocator's
    /// slack and the process itself. `None` where the OS does not say.
    #[serde(default)]
    pub resident_bytes: Option<u64>,
    /// Highest resident memory since start (`VmHWM` of `/proc/self/status`).
    #[serde(default)]
    pub peak_resident_bytes: Option<u64>,
    /// Device shape and counters.
    pub device: DeviceReport,
    /// Object store figures.
    pub store: StoreStats,
    /// Number of tables.
    pub tables: usize,
    /// Request counters.
    pub requests: RequestReport,
    /// Shipped code: modules compiled, cache hits, limits hit.
    #[serde(default)]
    pub sandbox: SandboxStats,
    /// Results kept by reference.
    #[serde(default)]
    pub refs: RefStats,
    /// Leased slots.
    #[serde(default)]
    pub leases: LeaseStats,
    /// Bytes several requests share (key filters), kept by digest.
    #[serde(default)]
    pub attachments: AttachmentStats,
}

/// Device part of [`NodeStats`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeviceReport {
    /// Shape.
    pub geometry: Geometry,
    /// Counters.
    pub stats: DeviceStats,
}

/// Request part of [`NodeStats`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RequestReport {
    /// DoGet calls.
    pub do_get: u64,
    /// DoPut calls.
    pub do_put: u64,
    /// Flight bytes sent (headers + bodies).
    pub bytes_sent: u64,
    /// Flight bytes received by DoPut.
    pub bytes_received: u64,
    /// Rows received by DoPut.
    pub rows_received: u64,
    /// Requests that proved no tenant (UNAUTHENTICATED).
    #[serde(default)]
    pub unauthenticated: u64,
    /// Requests refused for a permission or someone else's ticket (PERMISSION_DENIED).
    #[serde(default)]
    pub permission_denied: u64,
    /// Requests refused by a tenant's quota.
    #[serde(default)]
    pub quota_refused: u64,
}

/// Which requests the node runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Run, queue or push back by predicted delay and memory (the default).
    #[default]
    Adaptive,
    /// Run everything pushed down, queueing without a delay bound (up to
    /// `max_queued`); memory that can never fit is still pushed back.
    Always,
    /// Push every operator request back (the node serves raw reads only).
    Never,
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "adaptive" => Ok(Policy::Adaptive),
            "always" => Ok(Policy::Always),
            "never" => Ok(Policy::Never),
            _ => Err(format!(
                "unknown admission policy {s:?} (adaptive, always, never)"
            )),
        }
    }
}
/// Per-operator learned cost.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CostModel {
    /// Learned nanoseconds per byte read.
    pub ns_per_byte: f64,
    /// Finished requests learned from.
    pub samples: u64,
    /// Mean absolute relative error of the estimates (weighted like the cost).
    pub mean_abs_error: f64,
}
fn one() -> f64 {
    1.0
}

/// Running totals (all requests since start).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Counters {
    /// Operator requests run (at once or after queueing).
    pub admitted: u64,
    /// Of those, the ones that waited in the queue.
    pub queued: u64,
    /// Operator requests pushed back to the compute tier.
    pub pushed_back: u64,
    /// Patient requests queued past the delay bound (their asker was saturated).
    pub patient: u64,
    /// Requests queued past the delay bound because handing them back would cost
    /// their asker more (its link and cores) than waiting here.
    #[serde(default)]
    pub kept_for_link: u64,
    /// Requests queued past the delay bound because their asker runs on this node's
    /// own cores: handed back, they would run there behind the same work.
    #[serde(default)]
    pub kept_shared_cores: u64,
    /// Requests refused with RESOURCE_EXHAUSTED.
    pub rejected: u64,
    /// Queued requests whose client went away before they ran.
    pub abandoned: u64,
    /// Sum of queueing delays, microseconds.
    pub queue_delay_us_sum: u64,
    /// Largest queueing delay, microseconds.
    pub queue_delay_us_max: u64,
    /// Slot-microseconds used by finished requests.
    pub busy_us: u64,
}

/// A snapshot for `DoAction stats` and the metrics endpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AdmissionStats {
    /// The policy.
    pub policy: Policy,
    /// Slots (CPU workers).
    pub slots: usize,
    /// Slots leased out now (other work sees fewer).
    #[serde(default)]
    pub leased: usize,
    /// Memory leases hold for the requests run on them.
    #[serde(default)]
    pub lease_memory: u64,
    /// Memory budget.
    pub memory_budget: u64,
    /// Queueing-delay target, milliseconds.
    pub queue_target_ms: f64,
    /// Requests running now.
    pub running: usize,
    /// Requests waiting now.
    pub waiting: usize,
    /// Memory reserved by running requests.
    pub memory_reserved: u64,
    /// Raw reads in flight and waiting.
    pub io_in_flight: usize,
    /// Raw reads waiting.
    pub io_waiting: usize,
    /// Totals.
    pub counters: Counters,
    /// Recent queueing delays of admitted requests (ms): p50 and p99 of the last 1024.
    pub queue_delay_p50_ms: f64,
    /// See `queue_delay_p50_ms`.
    pub queue_delay_p99_ms: f64,
    /// What the node multiplies its queueing predictions by: the 90th percentile of
    /// actual over predicted queueing lately (1 until learned).
    #[serde(default = "one")]
    pub queue_prediction_scale: f64,
    /// Learned costs per operator.
    pub costs: BTreeMap<String, CostModel>,
    /// Request shapes with a cost of their own (see the module docs).
    #[serde(default)]
    pub cost_shapes: usize,
    /// Per tenant: admitted, pushed back, running, waiting.
    pub tenants: BTreeMap<String, TenantStats>,
}

/// One tenant's figures.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TenantStats {
    /// Admitted requests.
    pub admitted: u64,
    /// Pushed-back requests.
    pub pushed_back: u64,
    /// Running now.
    pub running: usize,
    /// Waiting now.
    pub waiting: usize,
}

/// Shape of a device: what an NVMe namespace's identify data would tell.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Geometry {
    /// Backend and target, for humans (e.g. `io_uring:/data/csd.img`).
    pub name: String,
    /// Logical block size in bytes.
    pub block_size: usize,
    /// Number of logical blocks.
    pub num_blocks: u64,
    /// Most commands in flight at once.
    pub queue_depth: usize,
}

impl Geometry {
    /// Capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.num_blocks * self.block_size as u64
    }
}
/// A snapshot of `DeviceCounters`.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct DeviceStats {
    /// Read commands completed.
    pub reads: u64,
    /// Write commands completed.
    pub writes: u64,
    /// Flush commands completed.
    pub flushes: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Bytes the device was told are free (NVMe Dataset Management, deallocate).
    #[serde(default)]
    pub bytes_deallocated: u64,
    /// Commands the kernel gave up on before the device answered (EINTR, EAGAIN)
    /// and that were sent again.
    #[serde(default)]
    pub retried: u64,
}

/// Store figures for `DoAction stats`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StoreStats {
    /// Committed objects.
    pub objects: usize,
    /// Sum of object lengths.
    pub bytes_stored: u64,
    /// Blocks in the data region.
    pub data_blocks: u64,
    /// Of which free.
    pub free_blocks: u64,
    /// Free runs (fragmentation).
    pub free_runs: usize,
    /// Blocks of abandoned uploads not yet returned to the free map.
    #[serde(default)]
    pub abandoned_blocks: u64,
    /// Block size.
    pub block_size: u32,
    /// Checksum chunk size.
    pub chunk_size: u32,
    /// Catalog commit generation.
    pub catalog_generation: u64,
    /// Bytes of the live catalog and the slot capacity.
    pub catalog_bytes: usize,
    /// Slot capacity in bytes.
    pub catalog_capacity: usize,
    /// The read cache (`--read-cache`): its capacity, the verified bytes it holds,
    /// and reads it answered and missed.
    #[serde(default)]
    pub read_cache: ReadCacheStats,
    /// Reads refused since start because the stored bytes were damaged or could not
    /// be read (each a DATA_LOSS naming the object).
    #[serde(default)]
    pub corrupt_reads: u64,
    /// Scrubs since start and what they found.
    #[serde(default)]
    pub scrub: ScrubReport,
}

/// What scrubbing the object store found: every chunk of every object read from the
/// device and checked against its checksum.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ScrubReport {
    /// Scrubs run (all of them, in the node's figures; 1 in one scrub's answer).
    pub runs: u64,
    /// Objects checked.
    pub objects: u64,
    /// Bytes read and checked.
    pub bytes: u64,
    /// Damaged ranges found, each naming its object and bytes (the first 64).
    pub damaged: Vec<String>,
    /// Damaged ranges found, in all.
    pub damaged_count: u64,
    /// Seconds spent.
    pub seconds: f64,
}

/// Figures of the node's read cache (`--read-cache`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ReadCacheStats {
    /// Bytes it may hold (0: off).
    pub capacity: u64,
    /// Bytes it holds.
    pub bytes: u64,
    /// Reads answered from it.
    pub hits: u64,
    /// Reads that went to the device.
    pub misses: u64,
}

/// The sandbox's figures (in a node's `stats`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SandboxStats {
    /// Modules compiled from their bytes.
    pub compiled: u64,
    /// Time spent compiling, in all (ms).
    pub compile_ms: f64,
    /// Compiled modules read back from the device (after a restart or eviction).
    pub loaded_from_device: u64,
    /// Requests whose module was already compiled in memory.
    pub cache_hits: u64,
    /// Modules in the in-memory cache now.
    pub cached: usize,
    /// Instances created.
    pub instances: u64,
    /// Calls ended by the CPU-time limit.
    pub deadline_exceeded: u64,
    /// Instances refused memory.
    pub memory_refused: u64,
    /// Calls ended by a trap or an ABI violation.
    pub traps: u64,
    /// Linear memory live instances hold now (taken from the node's budget).
    pub memory_held: u64,
}

/// Attachments (`put_attachment`), in `stats`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct AttachmentStats {
    /// Attachments kept now.
    pub kept: usize,
    /// Their bytes (held in the memory budget).
    pub bytes: u64,
    /// Attachments received and kept, since start (one sent again counts again).
    pub received: u64,
    /// Requests that found the attachment they named.
    pub used: u64,
    /// Requests refused because the attachment they named was not kept.
    pub missing: u64,
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

/// Leases in `stats`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct LeaseStats {
    /// Leases held now.
    pub live: u64,
    /// Slots they hold.
    pub slots: u64,
    /// Granted since start.
    pub granted: u64,
    /// Refused since start (the node could not spare the slots).
    pub refused: u64,
    /// Ended by expiry since start.
    pub expired: u64,
    /// Operator requests run on leases since start.
    #[serde(default)]
    pub runs: u64,
}

/// A Flight SQL gateway's figures (`csd gateway`; `DoAction gateway_stats`, `csd
/// stats --gateway`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct GatewayStats {
    /// Distinct callers (bearer tokens, or none) seen since start.
    pub sessions: u64,
    /// Flight `Handshake`s answered (basic credentials turned into a bearer token).
    pub handshakes: u64,
    /// Statements planned (`GetFlightInfo` of a query or a prepared statement).
    pub statements: u64,
    /// Prepared statements created.
    pub prepared: u64,
    /// Queries whose answer was streamed (`DoGet`), begun.
    pub queries: u64,
    /// Of those, ended by an error.
    pub queries_failed: u64,
    /// Of those, stopped by `CancelFlightInfo` / `CancelQuery` or the client going
    /// away.
    pub queries_cancelled: u64,
    /// Streaming now.
    pub running: u64,
    /// Rows sent to clients.
    pub rows_sent: u64,
    /// Requests refused for their credentials.
    pub unauthenticated: u64,
}
