//! # csd-runtime: the storage node
//!
//! * [`device`]: NVMe-shaped block devices (io_uring + O_DIRECT, emulated NVMe).
//! * [`store`]: a crash-safe, checksummed object store on raw blocks.
//! * [`table`]: tables and partitions held as Parquet objects the node writes itself.
//! * [`protocol`]: the node's protocol over Arrow Flight, as types both sides use:
//!   tickets, actions and their bodies, metadata keys, limits.
//! * [`admission`]: run now, queue, or push back; per-tenant fairness; raw-read limits.
//! * [`operator`]: the one trait pushed-down work (SQL fragments, DNN prefixes) plugs into.
//! * [`sandbox`]: shipped code: WebAssembly modules run under CPU, memory and stack
//!   limits, compiled once per digest (the guest ABI is documented there).
//! * `state`: a running node's shared state.
//! * `service`: the Arrow Flight service (`DoPut`, `DoGet`, `ListFlights`, `DoAction`).
//! * [`node_client`]: [`NodeClient`](node_client::NodeClient), the Rust side of the protocol.
//! * [`config`] and [`node`]: a node's settings and its start-up.
//! * `metrics`: Prometheus text metrics over HTTP.
//! * [`pool`]: the CPU pool operator work runs on.
//! * [`timer`]: a microsecond-precision timer for emulation (devices, links).
//!
//! Errors: [`Error`], whose kind ([`StatusCode`]) is one gRPC code.
//!
//! Dependencies point down: this crate knows nothing of SQL or DNNs, and inside it
//! `protocol` ← `operator` ← `state` ← `service` ← `node`, without cycles.

#![warn(unreachable_pub)]

pub mod admission;
pub mod attachments;
pub mod auth;
pub mod config;
mod deleted;
pub mod device;
mod flags;
pub mod lease;
mod metrics;
pub mod node;
pub mod operator;
pub mod pool;
pub mod refs;
pub mod sandbox;
mod scrubber;
mod service;
pub mod settings;
pub mod sketch;
mod state;
pub mod store;
pub mod table;
pub mod timer;
pub mod tls;

pub use csd_protocol as protocol;
pub use csd_protocol::{Error, Result, StatusCode, error, link, node_client};
pub use csd_sandbox::memory;
