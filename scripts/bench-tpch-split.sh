#!/usr/bin/env bash
# TPC-H with the storage node and the compute tier on disjoint cores, so the run
# models separate machines (the in-process bench shares every core between them).
#
#   scripts/bench-tpch-split.sh [NODE_CORES] [COMPUTE_CORES] [-- tpch args…]
#   e.g. scripts/bench-tpch-split.sh 1 0 -- --scale 1 --parts 2 --links 0,1000
#
# Cores are `taskset -c` lists (default: node on the last core, compute on the rest).
set -euo pipefail
cd "$(dirname "$0")/.."
last=$(( $(nproc) - 1 ))
node_cores=${1:-$last}
compute_cores=${2:-0-$(( last > 0 ? last - 1 : 0 ))}
shift $(( $# >= 2 ? 2 : $# ))
[[ "${1:-}" == "--" ]] && shift
cargo build --release --workspace --bin csd --bin tpch  # --workspace: -p would unify features differently and rebuild everything
target=${CARGO_TARGET_DIR:-target}/release
dir=$(mktemp -d)
trap 'kill "${node_pid:-}" 2>/dev/null || true; wait 2>/dev/null; rm -rf "$dir"' EXIT
ncpus=$(taskset -c "$node_cores" nproc)
taskset -c "$node_cores" "$target/csd" serve --device "$dir/node.img" --capacity 4GiB \
    --format --listen 127.0.0.1:50551 --cpus "$ncpus" --memory 4GiB >"$dir/node.log" 2>&1 &
node_pid=$!
for _ in $(seq 100); do
    grep -q "listening" "$dir/node.log" 2>/dev/null && break
    sleep 0.1
done
echo "node on cores $node_cores ($ncpus workers), compute on cores $compute_cores"
taskset -c "$compute_cores" "$target/tpch" --node grpc://127.0.0.1:50551 "$@"
