#!/usr/bin/env bash
# What a storage node in a QEMU guest needs (`[nodes] system = "qemu"`, the NVMe
# passthrough tests): QEMU (TCG), a static busybox, and Debian's cloud kernel — its
# vmlinuz (NVMe and io_uring built in) and the virtio-net modules, in load order —
# unpacked into $CSD_QEMU_HOME (default ~/.cache/csd/qemu), with uio and
# uio_pci_generic for guests whose node drives the controller with SPDK. Idempotent;
# no install hooks run for the kernel (it is only unpacked).
#
#   scripts/setup-qemu.sh                  # x86-64 guests (what scripts/test.sh runs)
#   scripts/setup-qemu.sh --arch aarch64   # arm64 guests, a CSD's ARM cores: adds
#                                          # qemu-system-arm, Debian's arm64 cloud
#                                          # kernel and busybox into $CSD_QEMU_HOME/arm64,
#                                          # and, where scripts/setup-ml.sh has run,
#                                          # onnxruntime's aarch64 library (from its
#                                          # PyPI wheel, the version the host's is)
set -euo pipefail
arch=x86_64
if [ "${1:-}" = "--arch" ]; then arch="${2:?--arch takes x86_64 or aarch64}"; fi
home="${CSD_QEMU_HOME:-$HOME/.cache/csd/qemu}"
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
need=()
case "$arch" in
  x86_64)
    deb=amd64
    command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
    dpkg -s busybox-static >/dev/null 2>&1 || need+=(busybox-static)
    ;;
  aarch64)
    deb=arm64
    home="$home/arm64"
    command -v qemu-system-aarch64 >/dev/null || need+=(qemu-system-arm)
    # The arm64 packages below are downloaded, never installed.
    dpkg --print-foreign-architectures | grep -qx arm64 || {
      as_root dpkg --add-architecture arm64
      as_root apt-get update -qq
    }
    ;;
  *) echo "setup-qemu: --arch $arch: x86_64 or aarch64" >&2; exit 2 ;;
esac
command -v strip >/dev/null || need+=(binutils)
if [ ${#need[@]} -gt 0 ]; then
  as_root apt-get update -qq
  as_root apt-get install -y -qq "${need[@]}"
fi
# The aarch64 onnxruntime for arm64 guests' ONNX models: the manylinux aarch64 wheel
# of the version scripts/setup-ml.sh installed here, its libonnxruntime.so unpacked.
arm64_onnxruntime() {
  local py="${CSD_ML_HOME:-$HOME/.cache/csd/ml}/venv/bin/python" version dl lib
  [ -f "$home/onnxruntime/libonnxruntime.so" ] && return 0
  if [ ! -x "$py" ]; then
    echo "setup-qemu: no onnxruntime for arm64 guests (run scripts/setup-ml.sh, then this again)"
    return 0
  fi
  version="$("$py" -c 'import onnxruntime; print(onnxruntime.__version__)')"
  dl="$(mktemp -d)"
  "$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --platform manylinux_2_28_aarch64 -d "$dl" "onnxruntime==$version"
  mkdir -p "$home/onnxruntime"
  "$py" - "$dl"/onnxruntime-*.whl "$home/onnxruntime/libonnxruntime.so" <<'PY'
import shutil, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
name = next(n for n in z.namelist() if n.startswith("onnxruntime/capi/libonnxruntime.so."))
with z.open(name) as src, open(sys.argv[2] + ".new", "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  mv "$home/onnxruntime/libonnxruntime.so.new" "$home/onnxruntime/libonnxruntime.so"
  rm -rf "$dl"
  echo "setup-qemu: onnxruntime $version (aarch64) unpacked into $home/onnxruntime"
}
[ "$arch" = aarch64 ] && arm64_onnxruntime
if [ -f "$home/vmlinuz" ] && [ -f "$home/modules/order" ] && [ -f "$home/modules/spdk/uio_pci_generic.ko" ] \
  && { [ "$arch" = x86_64 ] || [ -x "$home/busybox" ]; }; then
  exit 0
fi
mkdir -p "$home"
work="$(mktemp -d)"
chmod 755 "$work"
trap 'rm -rf "$work"' EXIT
cd "$work"
download() { apt-get download "$1" >/dev/null 2>&1 || { as_root apt-get update -qq && apt-get download "$1"; }; }
if [ "$arch" = aarch64 ]; then
  download busybox-static:arm64
  dpkg-deb -x busybox-static_*_arm64.deb bb
  cp bb/bin/busybox "$home/busybox.new" && mv "$home/busybox.new" "$home/busybox"
fi
download "linux-image-cloud-$deb:$deb"
pkg="$(dpkg-deb -f linux-image-cloud-"$deb"_*.deb Depends | grep -o "linux-image-[0-9][^ ,]*-cloud-$deb" | head -n1)"
[ -n "$pkg" ] || { echo "setup-qemu: linux-image-cloud-$deb names no kernel package" >&2; exit 1; }
download "$pkg:$deb"
dpkg-deb -x "$pkg"_*.deb root
rm -rf "$home/modules.new" && mkdir -p "$home/modules.new"
# virtio_net and what it needs, in the order insmod must load them.
order=(virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci failover net_failover virtio_net)
for m in "${order[@]}"; do
  ko="$(find root -name "$m.ko" -path "*/modules/*" | head -n1)"
  [ -n "$ko" ] || { echo "setup-qemu: $pkg has no $m.ko" >&2; exit 1; }
  cp "$ko" "$home/modules.new/"
done
printf '%s\n' "${order[@]}" > "$home/modules.new/order"
# Loaded only in SPDK guests, by their own script (testbed/src/guest/spdk.rs).
mkdir -p "$home/modules.new/spdk"
for m in uio uio_pci_generic; do
  ko="$(find root -name "$m.ko" -path "*/modules/*" | head -n1)"
  [ -n "$ko" ] || { echo "setup-qemu: $pkg has no $m.ko" >&2; exit 1; }
  cp "$ko" "$home/modules.new/spdk/"
done
cp root/boot/vmlinuz-* "$home/vmlinuz.new"
echo "$pkg" > "$home/kernel"
rm -rf "$home/modules" && mv "$home/modules.new" "$home/modules"
mv "$home/vmlinuz.new" "$home/vmlinuz"
echo "setup-qemu: $pkg unpacked into $home"
