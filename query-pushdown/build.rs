//! Nothing is generated here. `protoc-bin-vendored` is a build dependency only so that
//! cargo downloads Google's protoc together with the workspace: the `substrait` crate's
//! build script runs protoc, and `scripts/protoc` (PROTOC in `.cargo/config.toml`)
//! finds that binary when the machine has no protoc of its own.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
}
