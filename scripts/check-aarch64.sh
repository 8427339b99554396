#!/usr/bin/env bash
# Runs the aarch64 `csd` (scripts/build-aarch64.sh) on this machine under qemu-user:
# 1. `csd demo` on an embedded aarch64 node: the 22 TPC-H queries with and without
#    pushdown, which fails if any answer differs;
# 2. an aarch64 `csd serve` (4 cores, 2 GiB, as a CSD's) queried by this machine's
#    x86-64 `csd`: a table put, queries pushed to it equal to the same queries read
#    by byte range without pushdown.
# Opt-in, not part of CI. Usage: scripts/check-aarch64.sh [SCALE] (default 0.01).
set -euo pipefail
cd "$(dirname "$0")/.."
scale="${1:-0.01}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/csd/target}"
arm="$CARGO_TARGET_DIR/aarch64-unknown-linux-gnu/debug/csd"
[ -x "$arm" ] || { echo "check-aarch64: build it first: scripts/build-aarch64.sh" >&2; exit 1; }
x86="$CARGO_TARGET_DIR/debug/csd"
[ -x "$x86" ] || cargo build -q -p csd-client --bin csd
arm_csd=(qemu-aarch64 -L /usr/aarch64-linux-gnu "$arm")
file "$arm"
echo "== csd demo on aarch64 (TPC-H SF $scale, emulated device)"
"${arm_csd[@]}" demo --scale "$scale" --device emulated:mem

echo "== an aarch64 node queried from x86-64"
work=$(mktemp -d)
trap 'kill $node 2>/dev/null || true; rm -rf "$work"' EXIT
"${arm_csd[@]}" serve --device emulated:mem --capacity 512MiB --cpus 4 --memory 2GiB \
  --listen 127.0.0.1:0 > "$work/serve.out" 2>"$work/serve.err" &
node=$!
for _ in $(seq 600); do grep -q grpc:// "$work/serve.out" 2>/dev/null && break; sleep 0.1; done
url=$(grep -o 'grpc://[^ ]*' "$work/serve.out" | head -1)
[ -n "$url" ] || { cat "$work/serve.err" >&2; exit 1; }
python3 - "$work/t.csv" <<'PY'
import sys
with open(sys.argv[1], "w") as f:
    f.write("id,k,city,v\n")
    for i in range(200000):
        f.write(f"{i},{i % 1009},{['oslo','lima','pune','kobe'][i % 4]},{(i * 31) % 997}\n")
PY
"$x86" put "$work/t.csv" --table t --node "$url"
fail=0
for q in \
  "SELECT k % 10 AS g, count(*) AS n, sum(v) AS s FROM t GROUP BY k % 10 ORDER BY g" \
  "SELECT id, v FROM t WHERE city = 'lima' AND v > 990 ORDER BY id" \
  "SELECT city, count(DISTINCT k) AS d, avg(v) AS a FROM t GROUP BY city ORDER BY city" \
  "SELECT k, sum(v) AS s FROM t GROUP BY k ORDER BY s DESC, k LIMIT 5"; do
  pushed=$("$x86" sql --format csv "$q" --node "$url" 2>"$work/err")
  here=$("$x86" sql --no-pushdown --format csv "$q" --node "$url" 2>/dev/null)
  if [ "$pushed" = "$here" ]; then echo "same answer: $q ($(tail -1 "$work/err"))"
  else echo "DIFFERENT: $q" >&2; fail=1; fi
done
exit $fail
