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
# The C guest (chase_c), compiled by Zig's clang from the `ziglang` PyPI wheel, kept
# in a venv beside the build cache. Without network it is skipped (its test says so).
zig_venv="${CSD_ZIG_VENV:-$HOME/.cache/csd/zig-venv}"
if [ ! -x "$zig_venv/bin/python" ] || ! "$zig_venv/bin/python" -c 'import ziglang' 2>/dev/null; then
  { python3 -m venv "$zig_venv" && "$zig_venv/bin/pip" install -q 'ziglang==0.17.1'; } >/dev/null 2>&1 \
    || echo "build-wasm-examples: could not install ziglang from PyPI; skipping the C guest" >&2
fi
if "$zig_venv/bin/python" -c 'import ziglang' 2>/dev/null; then
  "$zig_venv/bin/python" -m ziglang cc --target=wasm32-freestanding -O2 -nostdlib \
    -Wl,--no-entry -o "$target/wasm/chase_c.wasm" "$root/csd-runtime/guest/c/chase.c"
fi
echo "wasm examples in $target/wasm: $(cd "$target/wasm" && ls *.wasm | tr '\n' ' ')"
