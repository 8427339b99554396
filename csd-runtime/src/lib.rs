//! # csd-runtime: the storage node
//!
//! * [`device`]: NVMe-shaped block devices (io_uring + O_DIRECT, emulated NVMe).
//! * [`store`]: a crash-safe, checksummed object store on raw blocks.
//! * [`table`]: tables and partitions held as Parquet objects the node writes itself.
//! * [`ticket`]: the Flight ticket format (versioned protobuf), with input limits.
//! * [`admission`]: run now, queue, or push back; per-tenant fairness; raw-read limits.
//! * [`metrics`]: Prometheus text metrics over HTTP.
//! * [`operator`]: the one trait pushed-down work (SQL fragments, DNN prefixes) plugs into.
//! * [`service`]: the Arrow Flight service (`DoPut`, `DoGet`, `ListFlights`, `DoAction`).
//! * [`client`]: [`NodeClient`](client::NodeClient), the Rust side of the wire protocol.
//! * [`node`]: configuration and start-up of a whole node.
//! * [`timer`]: a microsecond-precision timer for emulation (devices, links).
//!
//! Dependencies point down: this crate knows nothing of SQL or DNNs.

pub mod device;
pub mod error;
pub mod store;

pub mod admission;
pub mod client;
pub mod metrics;
pub mod node;
pub mod operator;
pub mod pool;
pub mod service;
pub mod table;
pub mod ticket;
pub mod timer;
pub use error::{Error, Result};
