//! The one trait pushed-down work plugs into.
//!
//! A `DoGet` whose ticket is [`Ticket::Operator`](crate::protocol::Ticket::Operator)
//! names an operator (`"sql"`, `"ml"`, …) and carries its arguments as opaque bytes.
//! The node looks the operator up and has it parse the bytes once
//! ([`Operator::parse`]) into an [`OperatorRequest`]; from then on it asks that value:
//! the tables it reads and whether it runs shipped code (for the tenant's
//! permissions), its cost key and estimate (for admission), and finally
//! [`OperatorRequest::open`], on the CPU pool (so planning never runs on the RPC
//! threads). The node drives the returned batch stream on the same pool and sends it
//! as Arrow IPC (optionally LZ4/ZSTD compressed). After the last batch the node sends
//! one more `FlightData` whose `app_metadata` is the JSON
//! [`OperatorReport`](crate::protocol::OperatorReport) of the request: bytes read
//! from the device, bytes sent, rows scanned and returned, time at the node, how it
//! was admitted, and the operator's own typed details ([`RequestMetrics::set_details`]).
//!
//! Operators never see gRPC: they return [`Error`](crate::Error)s, which the service maps to
//! statuses (bad arguments must be [`Error::InvalidArgument`](crate::Error::InvalidArgument) with a message a person
//! understands).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::Result;
use crate::pool::CpuPool;
use crate::table::TableStore;

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
    /// The operator's own figures for the report: the fields of its typed details.
    details: Mutex<Map<String, Value>>,
}

impl RequestMetrics {
    /// Adds the fields of `details` (the operator's typed message, serialized as a
    /// JSON object; fields it leaves out stay as set before) to the report. A
    /// client reads them back with
    /// [`OperatorReport::details`](crate::protocol::OperatorReport::details).
    pub fn set_details<T: Serialize>(&self, details: &T) {
        let Ok(Value::Object(fields)) = serde_json::to_value(details) else {
            return;
        };
        if let Ok(mut d) = self.details.lock() {
            d.extend(fields);
        }
    }

    /// The details set so far (`null` if none), for the report.
    pub(crate) fn details(&self) -> Value {
        match self.details.lock() {
            Ok(d) if !d.is_empty() => Value::Object(d.clone()),
            _ => Value::Null,
        }
    }
}

/// What an operator may use of its node.
pub struct NodeResources {
    /// The node's tables.
    pub tables: TableStore,
    /// The CPU pool operator work runs on (`--cpus` workers).
    pub pool: CpuPool,
    /// The node's memory budget in bytes (`--memory`).
    pub memory_budget: u64,
    /// The budget's account: operators' memory pools draw on it, and get what the
    /// rest of the process leaves.
    pub memory: Arc<crate::memory::MemoryLedger>,
    /// Where shipped code (WebAssembly) runs: its engine, limits and module cache.
    pub sandbox: Arc<crate::sandbox::Sandbox>,
    /// Bytes several requests share, sent once (`put_attachment`).
    pub attachments: Arc<crate::attachments::Attachments>,
}

/// What an operator sees of its node and request.
#[derive(Clone)]
pub struct OperatorContext {
    /// The node: tables, CPU pool, budgets.
    pub node: Arc<NodeResources>,
    /// Figures of this request.
    pub metrics: Arc<RequestMetrics>,
    /// Who asked: what else the request may read (a shipped module's host reads).
    pub principal: crate::auth::Principal,
    /// Set once nobody waits for the answer any more (the asker went away, or its
    /// stream was dropped): work that cannot be dropped mid-way (a guest running
    /// on its thread) stops when it sees it.
    pub cancelled: Arc<AtomicBool>,
}

pub use crate::admission::CostKey;
pub use csd_sandbox::CancelOnDrop;

/// A kind of pushed-down work.
pub trait Operator: Send + Sync + 'static {
    /// The name tickets use.
    fn name(&self) -> &'static str;

    /// Decodes and checks a request's arguments, once: everything the node asks of
    /// the request afterwards it asks the returned value. Must be cheap (no data
    /// read) and must refuse malformed `args` with
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument), so bad requests are
    /// refused before they queue.
    fn parse(self: Arc<Self>, args: Bytes) -> Result<Box<dyn OperatorRequest>>;

    /// Memory the operator's requests hold now, in bytes (for the node's figures).
    fn memory_used(&self) -> u64 {
        0
    }
}

/// One request of an [`Operator`], parsed.
#[async_trait]
pub trait OperatorRequest: Send + Sync + 'static {
    /// The tables it reads: the node checks the tenant may read each before
    /// anything else happens.
    fn tables(&self) -> Vec<String>;

    /// Whether it runs code the tenant sent (WebAssembly): the node then checks the
    /// tenant's `code` permission too.
    fn ships_code(&self) -> bool {
        false
    }

    /// What admission learns its per-byte cost under (`None`: the operator's
    /// name; a request running a shipped module names the module).
    fn cost_key(&self) -> Option<CostKey> {
        None
    }

    /// What it will cost, before admission decides on it: the bytes it will read
    /// and the memory it needs. Must be cheap (look at the catalog; never read
    /// data); may refuse a request the node cannot serve (a table it does not
    /// hold). The default knows nothing: 0 bytes and [`DEFAULT_MEMORY`].
    async fn estimate(&self, _ctx: &OperatorContext) -> Result<Estimate> {
        Ok(Estimate::default())
    }

    /// Plans and returns the output stream. Runs on the CPU pool, after admission,
    /// which counts the request as one slot. The stream may run a few tasks of its
    /// own on the pool (the SQL operator splits a scan in two, so one part decodes
    /// while the other waits for the device); the pool's fixed worker count still
    /// bounds the node's CPU.
    async fn open(self: Box<Self>, ctx: OperatorContext) -> Result<OperatorStream>;
}

/// Memory assumed for a request whose operator does not say.
pub const DEFAULT_MEMORY: u64 = 32 << 20;

/// An operator's estimate of a request (see [`OperatorRequest::estimate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Estimate {
    /// Bytes it will read from the device (after the pruning it can foresee).
    pub bytes: u64,
    /// Memory it needs while running.
    pub memory: u64,
    /// The request's shape under its cost key, if the operator can tell: requests
    /// of one shape cost about the same per byte (the same plan over another
    /// partition), so admission learns their cost apart once one has run. `None`:
    /// the key's cost only.
    pub shape: Option<u64>,
}

impl Default for Estimate {
    fn default() -> Self {
        Estimate {
            bytes: 0,
            memory: DEFAULT_MEMORY,
            shape: None,
        }
    }
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

    /// Memory held by all operators' requests now.
    pub fn memory_used(&self) -> u64 {
        self.ops.values().map(|o| o.memory_used()).sum()
    }
}

impl std::fmt::Debug for OperatorRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.ops.keys()).finish()
    }
}

/// Copies the strings of `Utf8View`/`BinaryView` columns that reference much more
/// buffer memory than they use into fresh, tight buffers.
///
/// A filtered or sliced view array still points into the whole decoded page, and
/// Arrow IPC writes every buffer an array references: without this, 20 surviving
/// rows can carry megabytes of page data over the wire (and again for every slice
/// the Flight encoder cuts a large batch into). Arrays already tight are returned
/// as they are, so this costs one pass over the views.
pub(crate) fn compact_views(batch: RecordBatch) -> RecordBatch {
    // Re-packed when an array references over twice the bytes it uses.
    gc_views(batch, |buffers, used| buffers > 2 * used + 64 * 1024)
}

/// `batch` with the view columns for which `repack(referenced, used)` holds given
/// fresh, tight buffers.
fn gc_views(batch: RecordBatch, repack: impl Fn(usize, usize) -> bool) -> RecordBatch {
    use arrow::array::{Array, ArrayRef, AsArray};
    use arrow::datatypes::DataType;

    let mut changed = false;
    let columns: Vec<ArrayRef> = batch
        .columns()
        .iter()
        .map(|c| {
            let referenced = view_data_bytes(c.as_ref());
            let used = || match c.data_type() {
                DataType::Utf8View => c.as_string_view().lengths().map(|l| l as usize).sum(),
                _ => c.as_binary_view().lengths().map(|l| l as usize).sum(),
            };
            if referenced == 0 || !repack(referenced, used()) {
                return c.clone();
            }
            changed = true;
            match c.data_type() {
                DataType::Utf8View => Arc::new(c.as_string_view().gc()) as ArrayRef,
                _ => Arc::new(c.as_binary_view().gc()),
            }
        })
        .collect();
    if !changed {
        return batch;
    }
    RecordBatch::try_new_with_options(
        batch.schema(),
        columns,
        &arrow::record_batch::RecordBatchOptions::new().with_row_count(Some(batch.num_rows())),
    )
    .unwrap_or(batch)
}

/// Bytes of data buffers a `Utf8View`/`BinaryView` array references (0 for other
/// arrays, and for views whose values are all inline).
fn view_data_bytes(array: &dyn arrow::array::Array) -> usize {
    use arrow::array::AsArray;
    use arrow::datatypes::DataType;
    let buffers = match array.data_type() {
        DataType::Utf8View => array.as_string_view().data_buffers(),
        DataType::BinaryView => array.as_binary_view().data_buffers(),
        _ => return 0,
    };
    buffers.iter().map(|b| b.len()).sum()
}

/// Bytes Arrow IPC writes for `array`: the sliced range of fixed-width and offset
/// buffers, and every data buffer a view array references.
fn wire_bytes(array: &dyn arrow::array::Array) -> usize {
    let own = array
        .to_data()
        .get_slice_memory_size()
        .unwrap_or_else(|_| array.get_buffer_memory_size());
    own + view_data_bytes(array)
}

/// `batch` as it goes on the wire: view columns compacted ([`compact_views`]), and cut
/// into pieces of about `piece_bytes` whose view columns each get their own
/// tight buffers. Left to the Flight encoder, a large batch would be sliced with
/// every slice carrying all of its view data. (The encoder measures
/// buffer capacity, so a sliced array looks as large as the whole; encoders fed by
/// this take a limit well above `piece_bytes`.)
pub(crate) fn wire_pieces(batch: RecordBatch, piece_bytes: u64) -> Vec<RecordBatch> {
    let batch = compact_views(batch);
    let bytes: usize = batch.columns().iter().map(|c| wire_bytes(c.as_ref())).sum();
    let rows = batch.num_rows();
    let pieces = bytes
        .div_ceil(usize::try_from(piece_bytes.max(1)).unwrap_or(usize::MAX))
        .clamp(1, rows.max(1));
    if pieces == 1 {
        return vec![batch];
    }
    let per = rows.div_ceil(pieces);
    (0..rows)
        .step_by(per)
        .map(|start| {
            let piece = batch.slice(start, per.min(rows - start));
            gc_views(piece, |_, _| true)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const WIRE_PIECE_BYTES: usize = 2 << 20;
    use arrow::array::{Array, AsArray, StringViewArray};
    use arrow::ipc::writer::StreamWriter;

    fn ipc_len(b: &RecordBatch) -> usize {
        let mut w = StreamWriter::try_new(Vec::new(), &b.schema()).unwrap();
        w.write(b).unwrap();
        w.into_inner().unwrap().len()
    }

    #[test]
    fn large_batches_go_in_tight_pieces() {
        // 20,000 rows of 200-byte strings plus an integer column: about 4.3 MB.
        let long: Vec<String> = (0..20_000).map(|i| format!("{i:0200}")).collect();
        let s = StringViewArray::from_iter_values(long.iter());
        let n = arrow::array::Int64Array::from_iter_values(0..20_000);
        let batch =
            RecordBatch::try_from_iter([("s", Arc::new(s) as _), ("n", Arc::new(n) as _)]).unwrap();
        let whole = ipc_len(&batch);
        let pieces = wire_pieces(batch.clone(), WIRE_PIECE_BYTES as u64);
        assert!(pieces.len() >= 2, "{} pieces", pieces.len());
        let sizes: Vec<usize> = pieces.iter().map(ipc_len).collect();
        // Each piece carries only its own strings: no piece is much over the
        // target, and together they are about the whole batch, not a multiple.
        assert!(
            sizes
                .iter()
                .all(|&l| l < WIRE_PIECE_BYTES + WIRE_PIECE_BYTES / 4),
            "{sizes:?}"
        );
        let total: usize = sizes.iter().sum();
        assert!(
            total < whole + whole / 10,
            "{total} bytes for a {whole}-byte batch"
        );
        let joined = arrow::compute::concat_batches(&batch.schema(), &pieces).unwrap();
        assert_eq!(joined, batch);
        // A small batch goes as it is.
        let small = batch.slice(0, 100);
        assert_eq!(
            wire_pieces(small.clone(), WIRE_PIECE_BYTES as u64),
            vec![compact_views(small)]
        );
    }

    #[test]
    fn compact_views_drops_unreferenced_page_data() {
        let long: Vec<String> = (0..10_000)
            .map(|i| format!("a fairly long string {i:08}"))
            .collect();
        let a = StringViewArray::from_iter_values(long.iter());
        let batch = RecordBatch::try_from_iter([("s", Arc::new(a) as _)]).unwrap();
        let few = batch.slice(100, 20);
        let before = ipc_len(&few);
        let compacted = compact_views(few.clone());
        let after = ipc_len(&compacted);
        assert!(
            before > 200_000,
            "the slice carries the whole buffer: {before}"
        );
        assert!(after < 4_000, "compacted slice is tight: {after}");
        assert_eq!(compacted.column(0).as_string_view().value(3), long[103]);
        assert_eq!(compacted.column(0).len(), 20);
        // A tight batch is returned untouched.
        let same = compact_views(batch.clone());
        assert!(same.column(0).to_data().ptr_eq(&batch.column(0).to_data()));
    }
}
