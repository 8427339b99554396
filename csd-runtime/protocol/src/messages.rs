//! The JSON messages a node sends inside Flight messages: a table's description
//! (`FlightInfo.app_metadata`), what a put stored (`PutResult.app_metadata`), an
//! operator request's report (the `app_metadata` of its last `FlightData`), a
//! pushed-back request's reason (status metadata) and a stored object (the
//! `objects` action). The node's figures are in [`crate::stats`].

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// `app_metadata` of a table's `FlightInfo`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TableDescription {
    /// Table name.
    pub table: String,
    /// Partitions in name order.
    pub partitions: Vec<PartitionDescription>,
    /// Per column, the estimated distinct non-NULL values over every partition at
    /// this node (the union of its objects' sketches); empty or `None` when unknown
    /// (objects written without sketches).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub distinct: Vec<Option<u64>>,
    /// Copies of this table's partitions deleted while a node holding one may have
    /// been out of reach (`csd rm` of a partition kept in several copies): a copy
    /// listed anywhere whose objects' digests are one of these is deleted, not a
    /// replica; `csd repair` removes it. A node lists a table whose partitions are
    /// all deleted with these alone (no schema, no partitions).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deleted: Vec<DeletedCopy>,
}

/// A deleted copy of a partition, known by its objects' digests (a partition put
/// with `csd put --replicas` carries its put's id in every object's footer, so a
/// later put of the same partition, even of the same rows, has other digests).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct DeletedCopy {
    /// Partition name.
    pub partition: String,
    /// The digests of the copy's objects, in the order the partition lists them.
    pub digests: Vec<u32>,
}

impl DeletedCopy {
    /// The deleted copy `partition` is, if its objects are those of a deleted copy
    /// (every object's digest known and equal, in order).
    pub fn matches(&self, partition: &str, objects: &[ObjectDescription]) -> bool {
        self.partition == partition
            && self.digests.len() == objects.len()
            && self
                .digests
                .iter()
                .zip(objects)
                .all(|(d, o)| o.digest == Some(*d))
    }

    /// The deleted copy that `p` would be, if every object's digest is known.
    pub fn of(p: &PartitionDescription) -> Option<DeletedCopy> {
        Some(DeletedCopy {
            partition: p.name.clone(),
            digests: p.objects.iter().map(|o| o.digest).collect::<Option<_>>()?,
        })
    }
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
    /// Per column, the estimated distinct non-NULL values over the partition's
    /// objects; empty or `None` when unknown.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub distinct: Vec<Option<u64>>,
    /// Objects of the partition the node has lost (each message names one): the
    /// partition cannot be read whole, and reading it must fail with DATA_LOSS
    /// rather than read `objects` alone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lost: Vec<String>,
    /// The copies of the partition its writer asked for (`csd put --replicas`), one
    /// on each of that many nodes; 1 for a partition put once. The compute tier
    /// reads a table with nodes out of reach only while fewer nodes are out than
    /// its partitions have copies.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub copies: u32,
}

fn one() -> u32 {
    1
}

fn is_one(n: &u32) -> bool {
    *n == 1
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
    /// footer statistics; empty when unknown.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub int_ranges: Vec<Option<[i64; 2]>>,
    /// A digest of the object's bytes (CRC-32C of its chunks' CRC table): copies of
    /// a partition on several nodes are replicas only when their objects' digests
    /// agree. `None` from a node that does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<u32>,
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
    /// How the node admitted the request: its queueing, estimate, lease.
    #[serde(default)]
    pub admission: AdmissionReport,
    /// The operator's own figures: a JSON object of the operator's typed details
    /// (each operator's crate defines them), read with [`OperatorReport::details`].
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub details: serde_json::Value,
}

impl OperatorReport {
    /// The operator's details as its typed message `T` (`None` if the operator sent
    /// none, or other ones).
    pub fn details<T: DeserializeOwned>(&self) -> Option<T> {
        if self.details.is_null() {
            return None;
        }
        T::deserialize(&self.details).ok()
    }
}

/// How a node admitted one operator request (part of its [`OperatorReport`]).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct AdmissionReport {
    /// Time it waited for a slot, milliseconds.
    pub queue_ms: f64,
    /// The queueing admission predicted for it (scaled), milliseconds.
    pub predicted_queue_ms: f64,
    /// Its estimated run time at the node, milliseconds.
    pub estimate_ms: f64,
    /// The bytes its operator estimated it reads.
    pub estimate_bytes: u64,
    /// The asker sent it patient (queue rather than hand back for delay).
    pub patient: bool,
    /// Queued past the delay bound because handing it back would have cost the
    /// asker more (its link and cores).
    pub kept_for_link: bool,
    /// Queued past the delay bound because its asker runs on this node's own cores.
    #[serde(default)]
    pub kept_shared_cores: bool,
    /// Why it waited, for a person (`None`: it did not, or not notably).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_reason: Option<String>,
    /// The lease it ran on (`None`: admitted, not leased).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<String>,
}

/// A run of physical blocks on a node's device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extent {
    /// First logical block address.
    pub lba: u64,
    /// Number of blocks.
    pub blocks: u64,
}

impl Extent {
    /// One past the last block.
    pub fn end(&self) -> u64 {
        self.lba + self.blocks
    }
}

/// A stored object as the `objects` action lists it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ObjectEntry {
    /// Full name.
    pub name: String,
    /// Stable id (changes when the object is replaced).
    pub id: u64,
    /// Length in bytes.
    pub len: u64,
    /// Extents holding its data and checksum table.
    pub extents: Vec<Extent>,
    /// Creation time, ms since the Unix epoch.
    pub created_unix_ms: u64,
}

/// Why a request was pushed back, sent to the client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PushBack {
    /// A sentence for a person.
    pub reason: String,
    /// Predicted queueing delay at the node, in milliseconds.
    pub predicted_delay_ms: f64,
    /// Estimated run time at the node, in milliseconds.
    pub estimate_ms: f64,
    /// Bytes the request would have read at the node (the work handed back).
    #[serde(default)]
    pub bytes: u64,
    /// Whose decision it was: another node holding the same data may decide
    /// otherwise only when it was this node's admission.
    #[serde(default)]
    pub cause: PushBackCause,
}

/// Why a node pushed work back (see [`PushBack::cause`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PushBackCause {
    /// The node's admission: its load, its queue or its configured budget and
    /// policy. Another node holding a copy of the data may run it.
    #[default]
    Admission,
    /// What the work does over this data (an aggregate that does not shrink, a
    /// join-key filter that keeps most rows): every copy of the data would judge
    /// alike.
    Judgement,
}
