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

/// Overwrites `len` bytes of the file at `path` from byte `at` with what `change`
/// makes of them, in place: a drive image is a sparse file as large as the node's
/// capacity, and reading it whole and writing it back would fill a small disk.
pub fn patch_at(path: &std::path::Path, at: u64, len: usize, change: impl FnOnce(&mut [u8])) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = vec![0u8; len];
    f.read_exact_at(&mut b, at).unwrap();
    change(&mut b);
    f.write_all_at(&b, at).unwrap();
    f.sync_all().unwrap();
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
