#!/usr/bin/env bash
# TPC-H over three nodes with every partition kept once, then twice: time, bytes moved
# and load time, every node up.
#
#   scripts/bench-replicas.sh DATA_DIR [RUNS]
#
# DATA_DIR holds TPC-H Parquet files as the shaped bench writes them (`lineitem-0.parquet`
# …, `nation.parquet`). For copies 1 then 2: three fresh `csd serve` processes on file
# devices; every file `T-I.parquet` is stored as partition `pI` of `T` (with 1 copy on
# node I mod 3, with 2 copies by `csd put --replicas 2`); each of the 22 queries runs
# RUNS times (default 3), one `csd sql` process each, on loopback. Prints per query the
# median time and the bytes moved for each, and the totals.
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:?give the data directory}
runs=${2:-3}
cargo build --release --workspace --bin csd  # --workspace: -p would unify features differently
csd=${CARGO_TARGET_DIR:-target}/release/csd
dir=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; wait 2>/dev/null; rm -rf "$dir"' EXIT

for copies in 1 2; do
    nodes=()
    for j in 0 1 2; do
        "$csd" serve --device "$dir/c$copies-n$j.img" --capacity 3GiB --format \
            --listen "127.0.0.1:$((50571 + j))" >"$dir/n$j.log" 2>&1 &
        pids+=($!)
        for _ in $(seq 300); do grep -q listening "$dir/n$j.log" 2>/dev/null && break; sleep 0.1; done
        nodes+=(--node "grpc://127.0.0.1:$((50571 + j))")
    done
    t0=$(date +%s.%N)
    for f in "$data"/*.parquet; do
        base=$(basename "$f" .parquet)
        table=${base%-*}; i=${base##*-}
        [[ "$base" == *-* ]] || { table=$base; i=0; }
        if [[ $copies == 1 ]]; then
            "$csd" put "$f" --table "$table" --partition "p$i" --node "grpc://127.0.0.1:$((50571 + i % 3))" >/dev/null
        else
            "$csd" put "$f" --table "$table" --partition "p$i" --replicas 2 "${nodes[@]}" >/dev/null
        fi
    done
    echo "copies $copies: loaded in $(echo "$(date +%s.%N) - $t0" | bc) s"
    for q in $(seq 1 22); do
        times=()
        for _ in $(seq "$runs"); do
            s=$(date +%s.%N)
            "$csd" sql "${nodes[@]}" --format csv -f "testbed/queries/tpch/q$q.sql" >"$dir/out.csv" 2>"$dir/err"
            times+=("$(echo "$(date +%s.%N) - $s" | bc)")
        done
        median=$(printf '%s\n' "${times[@]}" | sort -n | sed -n "$(( (runs + 1) / 2 ))p")
        bytes=$(grep -o '[0-9]* bytes moved' "$dir/err" | cut -d' ' -f1)
        cp "$dir/out.csv" "$dir/c$copies-q$q.csv"
        echo "$q $median $bytes" >>"$dir/c$copies.txt"
    done
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    pids=()
done
printf '%-5s %10s %12s %10s %12s %8s %8s\n' query "1 copy s" "1 copy MB" "2 copies s" "2 copies MB" time bytes
paste -d' ' "$dir/c1.txt" "$dir/c2.txt" | while read -r q t1 b1 _ t2 b2; do
    cmp -s "$dir/c1-q$q.csv" "$dir/c2-q$q.csv" || echo "q$q: answers differ" >&2
    printf 'q%-4s %10.2f %12.2f %10.2f %12.2f %7.2fx %7.2fx\n' "$q" "$t1" "$(echo "$b1/1000000" | bc -l)" \
        "$t2" "$(echo "$b2/1000000" | bc -l)" "$(echo "$t2/$t1" | bc -l)" "$(echo "$b2/$b1" | bc -l)"
done
paste -d' ' "$dir/c1.txt" "$dir/c2.txt" | awk '{t1+=$2; b1+=$3; t2+=$5; b2+=$6} END {printf "total %10.2f %12.2f %10.2f %12.2f %7.2fx %7.2fx\n", t1, b1/1e6, t2, b2/1e6, t2/t1, b2/b1}'
