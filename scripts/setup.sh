#!/usr/bin/env bash
# Installs what building and testing need beyond a Rust toolchain. Idempotent.
set -euo pipefail
need=()
command -v cargo >/dev/null || { echo "setup: install Rust (rustup) first" >&2; exit 1; }
rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy rustfmt >/dev/null 2>&1 || true
command -v cc >/dev/null || need+=(build-essential)
# Shipped code: the guest SDK and example guests build for wasm32-unknown-unknown.
rustup target list --installed 2>/dev/null | grep -q '^wasm32-unknown-unknown$' \
  || rustup target add wasm32-unknown-unknown >/dev/null 2>&1 \
  || echo "setup: could not add the wasm32-unknown-unknown target (rustup target add wasm32-unknown-unknown)" >&2
# datafusion-substrait builds the `substrait` crate, whose build script runs protoc.
command -v protoc >/dev/null || need+=(protobuf-compiler)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq "${need[@]}"
  else sudo apt-get update -qq && sudo apt-get install -y -qq "${need[@]}"; fi
fi
