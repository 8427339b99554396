//! The node's protocol on top of Arrow Flight, as types both sides use: the service
//! (`crate::service`) answers with them and [`NodeClient`](crate::node_client::NodeClient)
//! reads them, so a renamed field is a compile error, not a silent default.
//!
//! * [`ticket`]: `DoGet` tickets (versioned protobuf: scan, range, operator).
//! * [`actions`]: `DoAction` names and their typed JSON request and response bodies.
//! * [`messages`]: the JSON a node puts in `FlightInfo.app_metadata` (table
//!   descriptions), `PutResult.app_metadata` (what a put stored) and the trailing
//!   message of an operator answer (its report).
//! * [`ipc`]: checks on incoming Arrow IPC (`DoPut`) before it is decoded.
//! * The gRPC metadata keys and message limits below.

pub mod actions;
pub mod ipc;
pub mod messages;
pub mod ticket;

pub use actions::{
    ActionRequest, DeleteRequest, DeleteResponse, INVOKE, InvokeRequest, LeaseRequest,
    LeasesRequest, ObjectsRequest, PUT_MODULE, PutModuleResponse, RefDescription, RefsRequest,
    ReleaseLeaseRequest, ReleaseRequest, StatsRequest, TouchLeaseRequest,
};
pub use messages::{
    NodeStats, ObjectDescription, OperatorReport, PartitionDescription, PutSummary,
    TableDescription,
};
pub use ticket::{AskerFigures, Compression, Ticket};

/// Metadata key naming the tenant of a request (default `default`).
pub const TENANT_METADATA: &str = "csd-tenant";
/// Metadata key naming the leases an operator request may run on: lease ids,
/// comma-separated (see [`crate::lease`]).
pub const LEASE_METADATA: &str = "csd-lease";
/// Metadata key of a pushed-back request's JSON
/// [`PushBack`](crate::admission::PushBack), on `UNAVAILABLE`.
pub const PUSHBACK_METADATA: &str = "csd-pushback";
/// Metadata key of the retry hint (milliseconds) on `RESOURCE_EXHAUSTED`.
pub const RETRY_AFTER_METADATA: &str = "retry-after-ms";

/// `app_metadata` of a DoPut's first message by which the client promises to close
/// its upload with [`PUT_END`]. A stream that then ends without it was abandoned (a
/// dropped future, a source that failed: arrow-flight's client ends the stream
/// cleanly on either) and stores nothing. Clients that do not promise (any Flight
/// client) have their upload stored when the stream ends cleanly.
pub const PUT_MARKED: &[u8] = b"csd.put.marked";
/// `app_metadata` of the message, with no header or body, that closes a marked upload.
pub const PUT_END: &[u8] = b"csd.put.end";

/// Largest gRPC message a node or client accepts or sends.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;
/// HTTP/2 flow-control window per stream: how far a node may run ahead of a reader
/// that is busy (h2's default, 64 KiB, stalls a node streaming features after one
/// message while the compute tier runs its layers, so the two never overlap).
pub(crate) const STREAM_WINDOW: u32 = 8 << 20;
/// HTTP/2 flow-control window per connection (all of a node's streams together).
pub(crate) const CONNECTION_WINDOW: u32 = 32 << 20;
