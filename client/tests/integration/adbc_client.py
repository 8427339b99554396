"""A user's ADBC session against `csd gateway`, as the integration test drives it.

Usage: adbc_client.py URI CA_PEM TENANT TOKEN QUERIES_JSON OUT_DIR

Runs every query of QUERIES_JSON ({"name": sql}) through the ADBC Flight SQL
driver's DBAPI (prepared statements, as DBAPI does) and writes each answer to
OUT_DIR/NAME.arrow; then writes OUT_DIR/report.json with what the metadata calls,
a parameterised query, pandas and a wrong token gave.
"""

import json
import sys

import adbc_driver_flightsql.dbapi as fsql
import pyarrow as pa
import pyarrow.ipc as ipc


def connect(uri, ca, **auth):
    kwargs = {"adbc.flight.sql.client_option.tls_root_certs": ca}
    kwargs.update(auth)
    return fsql.connect(uri, db_kwargs=kwargs, autocommit=True)


def main():
    uri, ca_path, tenant, token, queries_path, out = sys.argv[1:7]
    ca = open(ca_path).read()
    queries = json.load(open(queries_path))
    report = {}
    # username/password: a Flight handshake (Basic without padding) -> bearer.
    with connect(uri, ca, username=tenant, password=token) as conn:
        with conn.cursor() as cur:
            for name, sql in queries.items():
                cur.execute(sql)
                table = cur.fetch_arrow_table()
                with ipc.new_file(f"{out}/{name}.arrow", table.schema) as w:
                    w.write_table(table)
            # A parameterised query (qmark style, bound by position).
            cur.execute(
                "SELECT o_orderkey, o_orderstatus FROM orders WHERE o_custkey = ? AND o_totalprice > ? ORDER BY o_orderkey",
                (370, 1000.5),
            )
            report["params"] = cur.fetch_arrow_table().to_pylist()
            # The same statement again with other values (a new bind, same prepare).
            cur.execute(
                "SELECT o_orderkey, o_orderstatus FROM orders WHERE o_custkey = ? AND o_totalprice > ? ORDER BY o_orderkey",
                (781, 0.0),
            )
            report["params2"] = cur.fetch_arrow_table().to_pylist()
            # pandas through the same cursor.
            cur.execute("SELECT n_name, n_regionkey FROM nation WHERE n_regionkey = 1 ORDER BY n_name")
            report["pandas"] = cur.fetch_df()["n_name"].tolist()
        # polars reads through the ADBC connection (the README's example).
        try:
            import polars as pl

            df = pl.read_database("SELECT r_name FROM region WHERE r_regionkey < 2 ORDER BY r_name", conn)
            report["polars"] = df["r_name"].to_list()
        except ImportError:
            report["polars"] = "not installed"
        objects = conn.adbc_get_objects(depth="all").read_all().to_pylist()
        report["catalogs"] = [o["catalog_name"] for o in objects]
        report["tables"] = sorted(
            t["table_name"]
            for o in objects
            for s in (o["catalog_db_schemas"] or [])
            for t in (s["db_schema_tables"] or [])
        )
        report["lineitem_columns"] = [
            c["column_name"]
            for o in objects
            for s in (o["catalog_db_schemas"] or [])
            for t in (s["db_schema_tables"] or [])
            if t["table_name"] == "lineitem"
            for c in (t["table_columns"] or [])
        ]
        schema = conn.adbc_get_table_schema("orders")
        report["orders_schema"] = [f.name for f in schema]
        info = conn.adbc_get_info()
        report["vendor_name"] = info.get("vendor_name")
        report["table_types"] = conn.adbc_get_table_types()
    # A bearer token given as the header works too.
    with connect(uri, ca, **{"adbc.flight.sql.authorization_header": "Bearer " + token}) as conn:
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) AS n FROM region")
            report["bearer_count"] = cur.fetch_arrow_table().column(0).to_pylist()
    # A wrong token is refused.
    try:
        with connect(uri, ca, username=tenant, password="wrong-" + token) as conn:
            with conn.cursor() as cur:
                cur.execute("SELECT 1")
                cur.fetch_arrow_table()
        report["wrong_token"] = "accepted"
    except Exception as e:  # the driver's error type varies by version
        report["wrong_token"] = f"{type(e).__name__}: {e}"
    json.dump(report, open(f"{out}/report.json", "w"), default=str)


if __name__ == "__main__":
    main()
