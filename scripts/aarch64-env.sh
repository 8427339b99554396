# Sourced by the aarch64 scripts: cargo's cross linker, the qemu-user runner and the
# C toolchain for aarch64-unknown-linux-gnu (Debian's gcc-aarch64-linux-gnu).
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++
export AR_aarch64_unknown_linux_gnu=aarch64-linux-gnu-ar
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/csd/target}"
