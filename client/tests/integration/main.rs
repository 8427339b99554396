//! csd-client integration tests: real nodes on 127.0.0.1:0, real Flight clients.
#![allow(clippy::unwrap_used)]

mod careless;
mod cli;
mod flight;
mod refs;
mod security;
mod wasm;

use csd_runtime::config::{ByteSize, NodeConfig};
use csd_runtime::node::{self, RunningNode};

/// A node on an emulated in-memory device.
pub async fn mem_node() -> RunningNode {
    node::start(&NodeConfig {
        device: "emulated:mem".into(),
        capacity: ByteSize::mib(256),
        listen: "127.0.0.1:0".into(),
        cpus: 2,
        ..NodeConfig::default()
    })
    .await
    .expect("start node")
}
