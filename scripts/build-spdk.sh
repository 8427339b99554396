#!/usr/bin/env bash
# Builds SPDK from a source tree you point it at, against the distribution's DPDK
# (Debian 12: libdpdk-dev 22.11), as shared libraries for a baseline x86-64 CPU
# (x86-64-v2: SSE4.2, no AVX, so it also runs under QEMU's TCG), for
# `cargo build --features spdk` (the node's `--device spdk:…`).
#
#   scripts/build-spdk.sh SPDK_SOURCE_DIR
#
# SPDK_SOURCE_DIR is a checkout of github.com/spdk/spdk at tag v25.09 (the newest
# whose DPDK library list DPDK 22.11 satisfies; 26.x links rte_argparse, new in
# DPDK 24.11). Afterwards point the build at it: `export SPDK_DIR=SPDK_SOURCE_DIR`.
set -euo pipefail
src="${1:?usage: scripts/build-spdk.sh SPDK_SOURCE_DIR (a github.com/spdk/spdk checkout at v25.09)}"
src="$(cd "$src" && pwd)"
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
need=()
for p in build-essential pkgconf python3 patchelf libdpdk-dev libaio-dev libssl-dev uuid-dev libncurses-dev libkeyutils-dev libclang-dev; do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  as_root apt-get update -qq
  as_root apt-get install -y -qq "${need[@]}"
fi
version="$(cat "$src/VERSION" 2>/dev/null || echo unknown)"
case "$version" in
  25.*) ;;
  *) echo "build-spdk: $src is SPDK $version; this script builds v25.09 against DPDK 22.11 (26.x needs DPDK 24.11)" >&2; exit 1 ;;
esac
cd "$src"
# configure insists on the isa-l submodule on x86_64, then turns ISA-L off without
# nasm (and we want it off: with nasm it would also build intel-ipsec-mb). A stub
# satisfies the check where the submodule was not fetched.
if [ ! -f isa-l/autogen.sh ]; then
  git submodule update --init --depth 1 isa-l 2>/dev/null || { mkdir -p isa-l && : > isa-l/autogen.sh; }
fi
if command -v nasm >/dev/null; then
  echo "build-spdk: nasm is installed; building with CONFIG_ISAL=n CONFIG_IPSEC_MB=n anyway" >&2
fi
# SPDK refuses DPDK 22.11 point releases after 22.11.4 at run time (it copies
# DPDK's private PCI bus structures and checks the version); Debian ships 22.11.11.
# The PCI bus is not used with the NVMe-oF/TCP and malloc devices csd drives on the
# host; for the PCIe driver in a guest, the structures were unchanged through
# 22.11.4 and are checked below against the installed headers where they exist.
dpdk="$(pkg-config --modversion libdpdk)"
case "$dpdk" in
  22.11.*)
    sed -i 's/if (minor > 4) {/if (minor > 99) {/' lib/env_dpdk/pci_dpdk.c
    for h in bus_pci_driver.h; do
      if [ -f "/usr/include/dpdk/$h" ] && ! diff -q "lib/env_dpdk/22.11/$h" "/usr/include/dpdk/$h" >/dev/null; then
        echo "build-spdk: note: DPDK $dpdk's $h differs from the copy SPDK was written against" >&2
      fi
    done
    ;;
esac
./configure --with-dpdk --with-shared --target-arch=x86-64-v2 \
  --disable-tests --disable-unit-tests --disable-examples \
  --without-nvme-cuse --without-vhost --without-virtio --without-fsdev \
  --without-crypto --without-idxd --without-usdt
env -u CFLAGS make -j"$(nproc)" CONFIG_ISAL=n CONFIG_IPSEC_MB=n
# Installed into /usr/local (its libraries' RUNPATH), where the loader finds them: a
# node built with `--features spdk` loads them at run time, their dependencies on
# each other resolved by name.
command -v patchelf >/dev/null || as_root apt-get install -y -qq patchelf
as_root make install CONFIG_ISAL=n CONFIG_IPSEC_MB=n >/dev/null
as_root ldconfig
echo "build-spdk: built SPDK $version in $src/build and installed it into /usr/local (export SPDK_DIR=$src)"
