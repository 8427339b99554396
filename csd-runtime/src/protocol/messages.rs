//! The JSON messages a node sends inside Flight messages: a table's description
//! (`FlightInfo.app_metadata`), what a put stored (`PutResult.app_metadata`), an
//! operator request's report (the `app_metadata` of its last `FlightData`), and the
//! node's figures (the `stats` action).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::admission::AdmissionStats;
use crate::device::{DeviceStats, Geometry};
use crate::store::StoreStats;

/// `app_metadata` of a table's `FlightInfo`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TableDescription {
    /// Table name.
    pub table: String,
    /// Partitions in name order.
    pub partitions: Vec<PartitionDescription>,
}

/// One partition in a [`TableDescription`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PartitionDescription {
    /// Partition name.
    pub name: String,
    /// Rows.
    pub rows: u64,
    /// Stored bytes.
    pub bytes: u64,
    /// Parquet objects, readable by `Range` tickets.
    pub objects: Vec<ObjectDescription>,
}

/// One Parquet object in a [`PartitionDescription`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ObjectDescription {
    /// Object name.
    pub name: String,
    /// Bytes.
    pub len: u64,
    /// Rows.
    pub rows: u64,
    /// Row groups.
    pub row_groups: usize,
    /// Per column: `[min, max]` of a NULL-free integer/date column, from exact
    /// footer statistics (see [`ParquetObject::int_ranges`](crate::table::ParquetObject::int_ranges)); empty when unknown.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub int_ranges: Vec<Option<[i64; 2]>>,
}

/// What one append stored.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PutSummary {
    /// Table.
    pub table: String,
    /// Partition.
    pub partition: String,
    /// The new Parquet object.
    pub object: String,
    /// Rows written.
    pub rows: u64,
    /// Parquet bytes written.
    pub bytes: u64,
    /// Row groups written.
    pub row_groups: usize,
}

/// What the node reports after a pushed-down request (the trailing `app_metadata`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct OperatorReport {
    /// Operator name.
    pub operator: String,
    /// Bytes read from the device.
    pub bytes_read: u64,
    /// Bytes of Arrow IPC sent (headers + bodies, after compression).
    pub bytes_sent: u64,
    /// Rows examined after pruning.
    pub rows_scanned: u64,
    /// Rows returned.
    pub rows_returned: u64,
    /// Wall time at the node from ticket arrival to the last batch, in microseconds.
    pub elapsed_us: u64,
    /// Operator-specific details (e.g. the plan that ran).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub details: BTreeMap<String, String>,
}

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
    pub sandbox: crate::sandbox::SandboxStats,
    /// Results kept by reference.
    #[serde(default)]
    pub refs: crate::refs::RefStats,
    /// Leased slots.
    #[serde(default)]
    pub leases: crate::lease::LeaseStats,
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
