//! csd-client integration tests: real nodes on 127.0.0.1:0, real Flight clients.
#![allow(clippy::unwrap_used)]

mod adbc;
mod careless;
mod cli;
mod flight;
mod refs;
mod security;
mod tidy;
mod wasm;

use csd_runtime::config::{ByteSize, NodeConfig};
use csd_runtime::node::{self, RunningNode};

/// The ML venv's Python if it has pyarrow (scripts/setup-ml.sh installs it); `None`
/// (and a line saying so) otherwise.
pub fn pyarrow_python() -> Option<std::path::PathBuf> {
    let python = csd_ml_pushdown::assets_dir().join("venv/bin/python");
    let has = std::process::Command::new(&python)
        .args(["-c", "import pyarrow.flight"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has {
        eprintln!(
            "skipping: no pyarrow in {} (scripts/setup-ml.sh installs it)",
            python.display()
        );
    }
    has.then_some(python)
}

/// The ML venv's Python if it has the ADBC Flight SQL driver (scripts/setup-ml.sh
/// installs it with pyarrow and pandas); `None` (and a line saying so) otherwise.
pub fn adbc_python() -> Option<std::path::PathBuf> {
    let python = pyarrow_python()?;
    let has = std::process::Command::new(&python)
        .args(["-c", "import adbc_driver_flightsql.dbapi, pandas"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has {
        eprintln!(
            "skipping: no adbc-driver-flightsql in {} (scripts/setup-ml.sh installs it)",
            python.display()
        );
    }
    has.then_some(python)
}

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
