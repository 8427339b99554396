"""Runs one SQL file with DuckDB over Parquet files, for the `shaped` bench.

    python duckdb_query.py --data http://10.0.0.2:8080 [--files 4] [--threads 2] \
        [--tables facts,dims] q1.sql

Each table (TPC-H's unless `--tables` names others) is a view over
`DATA/<table>.parquet`, or with `--files N` over its N files
`DATA/<table>-<i>.parquet` (small tables — nation, region, dims — stay one file):
a local path or
an http URL, read with the httpfs extension from the duckdb-extension-httpfs wheel,
external file cache off (cold, as a new process is). Prints the result as CSV on stdout and
`duckdb: N rows in X ms` (the query, after connecting and loading) on stderr.
"""
import argparse
import csv
import os
import sys
import time

import duckdb

TABLES = ["nation", "region", "part", "supplier", "partsupp", "customer", "orders", "lineitem"]
# Tables kept in one file in every layout (benches/src/bin/shaped/workload.rs).
ONE_FILE = ("nation", "region", "dims")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--threads", type=int)
    p.add_argument("--files", type=int, default=1)
    p.add_argument("--tables", default=",".join(TABLES))
    p.add_argument("sql_file")
    a = p.parse_args()
    con = duckdb.connect()
    if a.threads:
        con.execute(f"SET threads = {a.threads}")
    if a.data.startswith("http"):
        import duckdb_extension_httpfs

        ext = os.path.join(
            os.path.dirname(duckdb_extension_httpfs.__file__),
            "extensions",
            "v" + duckdb.__version__,
            "httpfs.duckdb_extension",
        )
        con.execute(f"LOAD '{ext}'")
        con.execute("SET enable_external_file_cache = false")
    for t in a.tables.split(","):
        if a.files == 1 or t in ONE_FILE:
            files = [f"{a.data}/{t}.parquet"]
        else:
            files = [f"{a.data}/{t}-{i}.parquet" for i in range(a.files)]
        listed = ", ".join(f"'{f}'" for f in files)
        con.execute(f"CREATE VIEW {t} AS SELECT * FROM read_parquet([{listed}])")
    sql = open(a.sql_file).read()
    started = time.perf_counter()
    cur = con.execute(sql)
    rows = cur.fetchall()
    ms = (time.perf_counter() - started) * 1e3
    w = csv.writer(sys.stdout, lineterminator="\n")
    w.writerow([d[0] for d in cur.description])
    for r in rows:
        w.writerow(["" if v is None else repr(v) if isinstance(v, float) else str(v) for v in r])
    print(f"duckdb: {len(rows)} rows in {ms:.1f} ms", file=sys.stderr)


if __name__ == "__main__":
    main()
