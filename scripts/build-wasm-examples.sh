#!/usr/bin/env bash
# Builds the guest SDK's example modules (csd-runtime/guest) for
# wasm32-unknown-unknown into $CARGO_TARGET_DIR/wasm/NAME.wasm (or target/wasm/).
# Idempotent: cargo rebuilds only what changed.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"
rustup target list --installed 2>/dev/null | grep -q '^wasm32-unknown-unknown$' \
  || rustup target add wasm32-unknown-unknown >/dev/null
(cd "$root/csd-runtime/guest" && cargo build --quiet --release --target wasm32-unknown-unknown \
  --target-dir "$target/wasm-build")
mkdir -p "$target/wasm"
for f in "$target"/wasm-build/wasm32-unknown-unknown/release/*.wasm; do
  cp -p "$f" "$target/wasm/"
done
echo "wasm examples in $target/wasm: $(cd "$target/wasm" && ls *.wasm | tr '\n' ' ')"
