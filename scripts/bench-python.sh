#!/usr/bin/env bash
# The Python package's feature-epoch bench as a user meets it: one `csd serve` in a
# network namespace behind a veth shaped with tc (RATE on both ends, default 1gbit),
# the images also served over HTTP from there for the plain-PyTorch baseline
# (HAPI's), and benches/features_epochs.py run here with release builds of `csd` and
# of the package's extension. Needs root, scripts/setup-ml.sh with CSD_ML_TORCH=1
# for the baseline, and a few minutes for the release build.
#   bash scripts/bench-python.sh [RATE] [-- features_epochs.py args…]
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
rate="${1:-1gbit}"
shift || true
[ "${1:-}" = "--" ] && shift
home="${CSD_ML_HOME:-$HOME/.cache/csd/ml}"
py="$home/venv/bin/python"
images="${CSD_BENCH_IMAGES:-$home/textures-bench/train}"
if [ -z "${CSD_BENCH_IMAGES:-}" ] && [ ! -s "$home/textures-bench/labels.csv" ]; then
  # 450 training patches of 200x200, 150 per class.
  "$py" scripts/texture_patches.py "$home/textures-bench" --patch 200 --per-class 250
fi
target="${CARGO_TARGET_DIR:-target}"
# --workspace: -p would unify features differently and rebuild everything.
cargo build --release --workspace --bin csd --lib
csd="$target/release/csd"
site="$(mktemp -d)"
ns="csd-py-$$"
host_dev="csdph$$"
peer_dev="csdpn$$"
cleanup() {
  ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
  sleep 0.5
  ip netns del "$ns" 2>/dev/null || true
  ip link del "$host_dev" 2>/dev/null || true
  rm -rf "$site"
}
trap cleanup EXIT
# The package as pip lays it out.
mkdir -p "$site/csd"
cp client/python/python/csd/* "$site/csd/"
cp "$target/release/lib_native.so" "$site/csd/_native.abi3.so"

ip netns add "$ns"
ip link add "$host_dev" type veth peer name "$peer_dev"
ip link set "$peer_dev" netns "$ns"
ip addr add 10.231.9.1/24 dev "$host_dev"
ip link set "$host_dev" up
ip netns exec "$ns" ip addr add 10.231.9.2/24 dev "$peer_dev"
ip netns exec "$ns" ip link set "$peer_dev" up
ip netns exec "$ns" ip link set lo up
if [ "$rate" != unshaped ]; then
  # A burst of about 10 ms of the rate, as benches/src/net.rs shapes it.
  tbf=(root tbf rate "$rate" burst 1250000 latency 50ms)
  tc qdisc add dev "$host_dev" "${tbf[@]}"
  ip netns exec "$ns" tc qdisc add dev "$peer_dev" "${tbf[@]}"
fi
ip netns exec "$ns" "$csd" serve --device emulated:mem --listen 10.231.9.2:50051 >"$site/node.log" 2>&1 &
ip netns exec "$ns" "$py" -m http.server 8000 --bind 10.231.9.2 --directory "$images" >"$site/http.log" 2>&1 &
for _ in $(seq 50); do
  "$csd" stats --node grpc://10.231.9.2:50051 >/dev/null 2>&1 && break
  sleep 0.2
done
echo "link: $rate; $(git rev-parse --short HEAD); $(nproc) cores"
PYTHONPATH="$site:$repo/benches" "$py" benches/features_epochs.py --node grpc://10.231.9.2:50051 \
  --images "$images" --weights "$home/efficientnet-lite0.safetensors" --csd "$csd" \
  --torch-url http://10.231.9.2:8000 --veth "$host_dev" "$@"
