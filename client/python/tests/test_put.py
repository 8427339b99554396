"""`csd.put` from what Python users hold: every form stores the same rows."""

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import csd


def frame(n, seed):
    return pa.table(
        {
            "id": pa.array(range(seed, seed + n), pa.int64()),
            "city": pa.array([["oslo", "lima", "pune"][i % 3] for i in range(n)]),
            "v": pa.array([float((i * 31) % 97) for i in range(n)]),
        }
    )


def check(nodes, table, want):
    got = csd.sql(nodes, f"SELECT city, count(*) AS n, sum(v) AS s FROM {table} GROUP BY city ORDER BY city")
    exp = want.group_by("city").aggregate([("v", "count"), ("v", "sum")]).sort_by("city")
    assert got.column("n").to_pylist() == exp.column("v_count").to_pylist()
    assert got.column("s").to_pylist() == exp.column("v_sum").to_pylist()


def test_every_form_stores_its_rows(nodes, work):
    t = frame(5000, 0)
    assert csd.put(nodes[0], "from_table", t) == 5000
    check(nodes, "from_table", t)
    assert csd.put(nodes[0], "from_pandas", t.to_pandas()) == 5000
    check(nodes, "from_pandas", t)
    path = os.path.join(work, "t.parquet")
    pq.write_table(t, path, row_group_size=1000)
    assert csd.put(nodes[1], "from_file", path) == 5000
    check(nodes, "from_file", t)
    assert csd.put(nodes[1], "from_reader", t.to_reader(max_chunksize=700)) == 5000
    check(nodes, "from_reader", t)
    polars = pytest.importorskip("polars")
    assert csd.put(nodes[0], "from_polars", polars.from_arrow(t)) == 5000
    check(nodes, "from_polars", t)


def test_partitions_on_two_nodes_read_as_one_table(nodes):
    a, b = frame(3000, 0), frame(2000, 3000)
    csd.put(nodes[0], "split_t", a, partition="p0")
    csd.put(nodes[1], "split_t", b, partition="p1")
    check(nodes, "split_t", pa.concat_tables([a, b]))


def test_a_stream_streams_and_one_that_fails_stores_nothing(nodes):
    t = frame(20000, 0)

    def batches(fail_at=None):
        for i, b in enumerate(t.to_batches(max_chunksize=1000)):
            if i == fail_at:
                raise ValueError("the source broke")
            yield b

    reader = pa.RecordBatchReader.from_batches(t.schema, batches())
    assert csd.put(nodes[0], "from_generator", reader) == 20000
    check(nodes, "from_generator", t)
    broken = pa.RecordBatchReader.from_batches(t.schema, batches(fail_at=7))
    with pytest.raises(csd.CsdError) as e:
        csd.put(nodes[0], "half_stored", broken)
    assert "the source broke" in e.value.message, e.value.message
    with pytest.raises(csd.CsdError) as e:
        csd.sql(nodes, "SELECT count(*) FROM half_stored")
    assert "half_stored" in e.value.message


def test_what_cannot_be_stored_is_refused(nodes, work):
    with pytest.raises(csd.CsdError) as e:
        csd.put(nodes[0], "bad", {"a": [1, 2]})
    assert "cannot store a dict" in e.value.message
    with pytest.raises(csd.CsdError) as e:
        csd.put(nodes[0], "bad", os.path.join(work, "missing.parquet"))
    assert e.value.code == "InvalidArgument" and "does not exist" in e.value.message
    with pytest.raises(csd.CsdError) as e:
        csd.put("grpc://127.0.0.1:1", "bad", frame(10, 0))
    assert "127.0.0.1:1" in e.value.message
