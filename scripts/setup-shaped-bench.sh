#!/usr/bin/env bash
# Installs what the `shaped` bench needs beyond a Rust toolchain (idempotent):
# nginx (Debian) to serve the Parquet files to DuckDB, and a Python virtual
# environment with DuckDB and its httpfs extension from PyPI, pinned, and ADBC's
# Flight SQL driver with pyarrow (the `adbc` system: a client of `csd gateway`).
# Usage: scripts/setup-shaped-bench.sh VENV_DIR
set -euo pipefail
venv=${1:?usage: setup-shaped-bench.sh VENV_DIR}
DUCKDB=1.5.5
ADBC=1.13.0
PYARROW=26.0.1
sudo_() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
need=()
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || need+=(nginx-light)
command -v tc >/dev/null || [ -x /usr/sbin/tc ] || need+=(iproute2)
if [ ${#need[@]} -gt 0 ]; then
  sudo_ apt-get update -qq && sudo_ apt-get install -y -qq "${need[@]}" >/dev/null
fi
if ! "$venv/bin/python" -c "import duckdb, duckdb_extension_httpfs; assert duckdb.__version__ == '$DUCKDB'" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "duckdb==$DUCKDB" "duckdb-extension-httpfs==$DUCKDB"
fi
if ! "$venv/bin/python" -c "import adbc_driver_flightsql, pyarrow; assert adbc_driver_flightsql.__version__ == '$ADBC'" 2>/dev/null; then
  "$venv/bin/pip" install -q "adbc-driver-flightsql==$ADBC" "pyarrow==$PYARROW"
fi
echo "setup-shaped-bench: nginx, tc, DuckDB $DUCKDB (httpfs) and ADBC $ADBC ready in $venv"
