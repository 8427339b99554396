//! # csd-runtime: the storage node
//!
//! * [`device`]: NVMe-shaped block devices (io_uring + O_DIRECT, emulated NVMe).
//! * [`store`]: a crash-safe, checksummed object store on raw blocks.
//! * [`table`]: tables and partitions held as Parquet objects the node writes itself.
//! * [`ticket`]: the Flight ticket format (versioned protobuf), with input limits.
//! * [`service`]: the Arrow Flight service (`DoPut`, `DoGet`, `ListFlights`, `DoAction`).
//! * [`node`]: configuration and start-up of a whole node.
//! * [`timer`]: a microsecond-precision timer for emulation (devices, links).
//!
//! Dependencies point down: this crate knows nothing of SQL or DNNs.

pub mod device;
pub mod error;
pub mod store;

pub mod node;
pub mod pool;
pub mod service;
pub mod table;
pub mod ticket;
pub mod timer;
pub use error::{Error, Result};
