"""ADBC's Flight SQL driver (DBAPI) on one connection to `csd gateway`, for the
`shaped` bench's `adbc` system. Reads commands from stdin, one a line, and answers
each with one JSON line on stdout:

    sql PATH            -> {"secs", "rows", "csv"}: the query (cursor.execute +
                           fetch_arrow_table), timed from execute to the last batch
    large TABLE         -> {"rows", "secs"}: `SELECT * FROM TABLE` through ADBC
    doget TABLE NODES   -> {"rows", "secs"}: the same table by a direct Flight DoGet
                           of its partitions from each node (comma-separated URLs;
                           pyarrow.flight)

    python adbc_query.py grpc://127.0.0.1:50071
"""
import csv
import io
import json
import sys
import time

import adbc_driver_flightsql.dbapi as fsql
import pyarrow.flight as fl


def as_csv(table):
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(table.column_names)
    for r in table.to_pylist():
        w.writerow(["" if v is None else repr(v) if isinstance(v, float) else str(v) for v in r.values()])
    return out.getvalue()


def main():
    conn = fsql.connect(sys.argv[1], autocommit=True)
    cur = conn.cursor()
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "sql":
            sql = open(args[0]).read()
            started = time.perf_counter()
            cur.execute(sql)
            table = cur.fetch_arrow_table()
            secs = time.perf_counter() - started
            answer = {"secs": secs, "rows": table.num_rows, "csv": as_csv(table)}
        elif cmd == "large":
            started = time.perf_counter()
            cur.execute(f"SELECT * FROM {args[0]}")
            rows = cur.fetch_arrow_table().num_rows
            answer = {"rows": rows, "secs": time.perf_counter() - started}
        elif cmd == "doget":
            table_name, nodes = args
            started = time.perf_counter()
            rows = 0
            for node in nodes.split(","):
                client = fl.connect(node)
                info = client.get_flight_info(fl.FlightDescriptor.for_path(table_name))
                rows += sum(client.do_get(e.ticket).read_all().num_rows for e in info.endpoints)
            answer = {"rows": rows, "secs": time.perf_counter() - started}
        else:
            answer = {"error": f"unknown command {cmd}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
