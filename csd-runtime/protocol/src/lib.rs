//! # csd-protocol: the storage node's protocol, and its Rust client
//!
//! What both sides of the wire use, and nothing of the node: a program that only
//! talks to nodes (a training loop, a service running SQL through the compute tier)
//! builds on this crate without the node's devices, object store or sandbox.
//!
//! * [`ticket`]: `DoGet` tickets (versioned protobuf: scan, range, operator, ref).
//! * [`actions`]: `DoAction` names and their typed JSON request and response bodies.
//! * [`messages`]: the JSON a node puts in `FlightInfo.app_metadata` (table
//!   descriptions), `PutResult.app_metadata` (what a put stored), the trailing
//!   message of an operator answer (its report), and a pushed-back request's reason.
//! * [`stats`]: the node's figures (the `stats` action), every part typed.
//! * [`refs`]: kept results as clients hold them ([`Reference`](refs::Reference)).
//! * [`ipc`]: checks on incoming Arrow IPC (`DoPut`) before it is decoded.
//! * [`error`]: [`Error`] and its kinds ([`StatusCode`]), mapped to gRPC statuses in one
//!   place ([`Error::to_status`]) and back ([`Error::from_status`]).
//! * [`node_client`]: [`NodeClient`](node_client::NodeClient), the Rust side of it all.
//! * [`link`]: a link's throughput learned from its transfers (both sides price
//!   handing work back with it); [`host`]: which host and cores a process runs on,
//!   and how busy they are (askers send it).
//! * [`credential`]: the `authorization` metadata a request carries (bearer or Basic),
//!   parsed the one way the nodes and the Flight SQL gateway both accept.
//! * [`digest`], [`size`], [`names`]: module digests, sizes as people write them,
//!   and what tables and partitions may be called.
//! * The gRPC metadata keys and message limits below.
//!
//! Dependencies point down: `error`, `host` ← `digest`, `size` ← `ticket`, `messages`,
//! `stats`, `refs`, `ipc` ← `actions` ← `link` ← `node_client`, without cycles.

#![warn(unreachable_pub)]

pub mod actions;
pub mod bodies;
pub mod credential;
pub mod digest;
pub mod error;
pub mod host;
pub mod ipc;
pub mod link;
pub mod messages;
pub mod names;
pub mod node_client;
pub mod refs;
pub mod size;
pub mod stats;
pub mod tcp;
mod text;
pub mod ticket;

pub use actions::{
    ActionRequest, DeleteRequest, DeleteResponse, GatewayStatsRequest, INVOKE, InvokeAnswer,
    InvokeRequest, LeaseIds, LeaseInfo, LeaseRequest, LeasesRequest, ObjectsRequest, PUT_MODULE,
    PutModuleResponse, RefDescription, RefsRequest, ReleaseLeaseRequest, ReleaseRequest,
    ScrubRequest, StatsRequest, TouchLeaseRequest,
};
pub use digest::ModuleDigest;
pub use error::{Error, Result, StatusCode};
pub use messages::{
    AdmissionReport, DeletedCopy, ObjectDescription, ObjectEntry, OperatorReport,
    PartitionDescription, PushBack, PushBackCause, PutSummary, TableDescription,
};
pub use size::ByteSize;
pub use stats::{GatewayStats, NodeStats, ScrubReport};
pub use ticket::{AskerFigures, Compression, Ticket};

/// Metadata key of the `authorization` header (a bearer token, or Basic for Flight's
/// handshake).
pub const AUTHORIZATION: &str = "authorization";
/// Metadata key naming the tenant of a request (default `default`).
pub const TENANT_METADATA: &str = "csd-tenant";
/// Metadata key naming the leases an operator request may run on: lease ids,
/// comma-separated (see [`LeaseRequest`]).
pub const LEASE_METADATA: &str = "csd-lease";
/// Metadata key of a pushed-back request's JSON
/// [`PushBack`], on `UNAVAILABLE`.
pub const PUSHBACK_METADATA: &str = "csd-pushback";
/// Metadata key of the retry hint (milliseconds) on `RESOURCE_EXHAUSTED`.
pub const RETRY_AFTER_METADATA: &str = "retry-after-ms";
/// Metadata key naming the module (`sha256:` and 64 hex digits) a node answered
/// `NOT_FOUND` for: the client sends the module's bytes and asks again.
pub const MISSING_MODULE_METADATA: &str = "csd-missing-module";
/// Metadata key of a `NOT_FOUND` for a missing attachment: its digest.
pub const MISSING_ATTACHMENT_METADATA: &str = "csd-missing-attachment";

/// `app_metadata` of a DoPut's first message by which the client promises to close
/// its upload with [`PUT_END`]. A stream that then ends without it was abandoned (a
/// dropped future, a source that failed: arrow-flight's client ends the stream
/// cleanly on either) and stores nothing. Clients that do not promise (any Flight
/// client) have their upload stored when the stream ends cleanly.
pub const PUT_MARKED: &[u8] = b"csd.put.marked";
/// The most copies of a partition a put may ask for (the third element of a
/// `DoPut` descriptor's path, `[table, partition, copies]` or `[table, partition,
/// copies, put]`, where `put` names the put the copies are of: the node keeps it
/// in the object's footer, so two puts of the same rows differ in their digests).
pub const MAX_COPIES: u32 = 16;
/// `app_metadata` of the message, with no header or body, that closes a marked upload.
pub const PUT_END: &[u8] = b"csd.put.end";
/// `app_metadata` of a DoPut's first message whose upload is not Arrow but the bytes
/// of another node's Parquet object of the partition in its descriptor (`[table,
/// partition]`), each message's body the next piece, closed by [`PUT_END`]: stored
/// byte for byte, so that the copies stay replicas (`csd repair`).
pub const PUT_OBJECT_COPY: &[u8] = b"csd.put.object-copy";

/// Largest gRPC message a node or client accepts or sends.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;
/// HTTP/2 flow-control window per stream: how far a node may run ahead of a reader
/// that is busy (h2's default, 64 KiB, stalls a node streaming features after one
/// message while the compute tier runs its layers, so the two never overlap).
pub const STREAM_WINDOW: u32 = 8 << 20;
/// HTTP/2 flow-control window per connection (all of a node's streams together).
pub const CONNECTION_WINDOW: u32 = 32 << 20;
