#!/usr/bin/env bash
# A node killed (SIGKILL) during each TPC-H query, with every partition on 2 of 3 nodes.
#
#   scripts/bench-kill.sh DATA_DIR [DELAY_SECONDS]
#
# DATA_DIR holds TPC-H Parquet files as the shaped bench writes them (`lineitem-0.parquet`
# … or `nation.parquet`), e.g. /tmp/shaped/shaped-data/sf1-shuffled-8files. Three `csd
# serve` processes on file devices; every file `T-I.parquet` is stored as partition `pI`
# of `T` with `csd put --replicas 2`. For each of the 22 queries (one `csd sql` process
# each): its answer and time with every node up; with node `q mod 3` killed
# DELAY_SECONDS (default 0.3) after the query started; and with that node dead before
# it starts. The node is restarted on the same device between queries. Prints one line
# per query and a summary; exits 1 if any answer differed or failed.
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:?give the data directory}
delay=${2:-0.3}
cargo build --release --workspace --bin csd  # --workspace: -p would unify features differently
csd=${CARGO_TARGET_DIR:-target}/release/csd
dir=$(mktemp -d)
pids=(0 0 0)
trap 'for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; wait 2>/dev/null; rm -rf "$dir"' EXIT

start() { # node index, extra args
    local j=$1; shift
    "$csd" serve --device "$dir/n$j.img" --capacity 3GiB --listen "127.0.0.1:$((50561 + j))" \
        "$@" >"$dir/n$j.log" 2>&1 &
    pids[j]=$!
    for _ in $(seq 300); do
        grep -q "listening" "$dir/n$j.log" 2>/dev/null && return
        sleep 0.1
    done
    echo "node $j did not start: $(cat "$dir/n$j.log")" >&2
    exit 1
}
nodes=()
for j in 0 1 2; do
    start "$j" --format
    nodes+=(--node "grpc://127.0.0.1:$((50561 + j))")
done
t0=$(date +%s.%N)
for f in "$data"/*.parquet; do
    base=$(basename "$f" .parquet)
    table=${base%-*}
    part=p${base##*-}
    [[ "$base" == *-* ]] || { table=$base; part=p0; }
    "$csd" put "$f" --table "$table" --partition "$part" --replicas 2 "${nodes[@]}" >/dev/null
done
echo "loaded $(ls "$data"/*.parquet | wc -l) files, 2 copies each, in $(echo "$(date +%s.%N) - $t0" | bc) s"

run() { # query file, output file; prints seconds, returns csd's status
    local s e rc=0
    s=$(date +%s.%N)
    "$csd" sql "${nodes[@]}" --format csv -f "$1" >"$2" 2>"$2.err" || rc=$?
    e=$(date +%s.%N)
    echo "$e - $s" | bc
    return $rc
}
right=0; wrong=0; before_right=0
printf '%-5s %9s %12s %13s  %s\n' query "up s" "killed-mid s" "dead-before s" verdict
for q in $(seq 1 22); do
    sql=testbed/queries/tpch/q$q.sql
    up=$(run "$sql" "$dir/up.csv") || { echo "q$q failed with every node up: $(cat "$dir/up.csv.err")" >&2; exit 1; }
    k=$((q % 3))
    # Killed mid-query.
    ( sleep "$delay"; kill -9 "${pids[k]}" ) &
    killer=$!
    mid_rc=0
    mid=$(run "$sql" "$dir/mid.csv") || mid_rc=$?
    wait "$killer" 2>/dev/null || true
    wait "${pids[k]}" 2>/dev/null || true
    # Dead before it starts.
    before_rc=0
    before=$(run "$sql" "$dir/before.csv") || before_rc=$?
    start "$k"
    verdict=right
    if [[ $mid_rc != 0 ]] || ! cmp -s "$dir/up.csv" "$dir/mid.csv"; then
        verdict="WRONG mid (rc $mid_rc: $(head -c 300 "$dir/mid.csv.err"))"
        wrong=$((wrong + 1))
    else
        right=$((right + 1))
    fi
    if [[ $before_rc == 0 ]] && cmp -s "$dir/up.csv" "$dir/before.csv"; then
        before_right=$((before_right + 1))
    else
        verdict="$verdict; WRONG before (rc $before_rc: $(head -c 300 "$dir/before.csv.err"))"
    fi
    printf 'q%-4s %9.2f %12.2f %13.2f  %s\n' "$q" "$up" "$mid" "$before" "$verdict"
done
echo "killed mid-query: $right/22 right; dead before the query: $before_right/22 right"
[[ $wrong == 0 && $before_right == 22 ]]
