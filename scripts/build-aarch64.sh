#!/usr/bin/env bash
# Cross-builds the `csd` binary for aarch64 Linux (a computational storage drive's
# ARM cores, an ARM server) with Debian's cross toolchain. Opt-in: neither the
# default build nor CI runs it. Installs what it needs (the Rust target, the cross
# gcc, qemu-user to run the result here) when missing.
#
#   scripts/build-aarch64.sh            # debug build
#   scripts/build-aarch64.sh --release  # release build
#
# Prints the binary's path; `qemu-aarch64 -L /usr/aarch64-linux-gnu PATH --help`
# runs it on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
target=aarch64-unknown-linux-gnu
rustup target list --installed 2>/dev/null | grep -q "^$target\$" || rustup target add "$target"
need=()
command -v aarch64-linux-gnu-gcc >/dev/null || need+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
command -v aarch64-linux-gnu-g++ >/dev/null || need+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64 >/dev/null || need+=(qemu-user)
command -v file >/dev/null || need+=(file)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq && $sudo apt-get install -y -qq "${need[@]}"
fi
source scripts/aarch64-env.sh
profile=debug
if [ "${1:-}" = "--release" ]; then profile=release; fi
args=(--target "$target" -p csd-client --bin csd)
[ "$profile" = release ] && args+=(--release)
cargo build "${args[@]}"
bin="$CARGO_TARGET_DIR/$target/$profile/csd"
file "$bin"
echo "$bin"
