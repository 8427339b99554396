//! The one trait pushed-down work plugs into.
//!
//! A `DoGet` whose ticket is [`Ticket::Operator`](crate::ticket::Ticket::Operator)
//! names an operator (`"sql"`, `"ml"`, …) and carries its arguments as opaque bytes.
//! The node looks the operator up, calls [`Operator::open`] on the CPU pool (so
//! validation and planning never run on the RPC threads), then drives the returned
//! batch stream on the same pool and sends it as Arrow IPC (optionally LZ4/ZSTD
//! compressed). After the last batch the node sends one more `FlightData` whose
//! `app_metadata` is the JSON [`OperatorReport`] of the request: bytes read from the
//! device, bytes sent, rows scanned and returned, time at the node.
//!
//! Operators never see gRPC: they return [`Error`]s, which the service maps to
//! statuses (bad arguments must be [`Error::InvalidArgument`] with a message a person
//! understands).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::service::NodeState;

/// A running operator's output.
pub struct OperatorStream {
    /// Schema of every batch.
    pub schema: SchemaRef,
    /// The batches; polled on the node's CPU pool.
    pub batches: BoxStream<'static, Result<RecordBatch>>,
}

/// Per-request figures an operator fills in while it runs (all relaxed atomics).
#[derive(Debug, Default)]
pub struct RequestMetrics {
    /// Bytes read from the device (after pruning: what was actually fetched);
    /// shareable with [`ObjectReader::with_counter`](crate::table::ObjectReader::with_counter).
    pub bytes_read: Arc<AtomicU64>,
    /// Rows the operator examined after pruning.
    pub rows_scanned: AtomicU64,
}

impl RequestMetrics {
    /// Adds `n` bytes read from the device.
    pub fn add_bytes_read(&self, n: u64) {
        self.bytes_read.fetch_add(n, Ordering::Relaxed);
    }
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

/// What an operator sees of its node and request.
#[derive(Clone)]
pub struct OperatorContext {
    /// The node: tables, CPU pool, budgets.
    pub node: Arc<NodeState>,
    /// Figures of this request.
    pub metrics: Arc<RequestMetrics>,
}

/// A kind of pushed-down work.
#[async_trait]
pub trait Operator: Send + Sync + 'static {
    /// The name tickets use.
    fn name(&self) -> &'static str;

    /// Validates `args`, plans, and returns the output stream. Runs on the CPU pool.
    async fn open(&self, ctx: OperatorContext, args: Bytes) -> Result<OperatorStream>;
}

/// The operators a node serves, by name.
#[derive(Clone, Default)]
pub struct OperatorRegistry {
    ops: BTreeMap<&'static str, Arc<dyn Operator>>,
}

impl OperatorRegistry {
    /// An empty registry (raw scans and ranges only).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `op` (replacing one of the same name).
    pub fn with(mut self, op: Arc<dyn Operator>) -> Self {
        self.ops.insert(op.name(), op);
        self
    }

    /// The operator called `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<dyn Operator>> {
        self.ops.get(name)
    }

    /// Registered names.
    pub fn names(&self) -> Vec<&'static str> {
        self.ops.keys().copied().collect()
    }
}

impl std::fmt::Debug for OperatorRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.ops.keys()).finish()
    }
}
