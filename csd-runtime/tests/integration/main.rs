//! csd-runtime integration tests: one binary, one module per area.
#![allow(clippy::unwrap_used)]

mod crash;
mod device;
mod sim;
mod store;

use std::path::PathBuf;

/// A scratch directory on a disk-backed filesystem (O_DIRECT fails on tmpfs).
pub fn scratch_dir() -> tempfile::TempDir {
    let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(&base).expect("create target tmpdir");
    tempfile::tempdir_in(base).expect("tempdir")
}

/// Deterministic contents for object `i` (its length varies with `i`).
pub fn contents(i: u64, len: usize) -> Vec<u8> {
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
