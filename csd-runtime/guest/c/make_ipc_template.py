"""Prints the Arrow IPC stream chase.c embeds as OUTPUT: one row of three non-null
int64 columns (hops, last, sum) with marker values, and the offsets of the values.
Needs pyarrow."""
import io

import pyarrow as pa

schema = pa.schema([pa.field(n, pa.int64(), False) for n in ("hops", "last", "sum")])
markers = [0x1111111111111111, 0x2222222222222222, 0x3333333333333333]
sink = io.BytesIO()
with pa.ipc.new_stream(sink, schema) as w:
    w.write_batch(pa.record_batch([pa.array([m], pa.int64()) for m in markers], schema=schema))
data = sink.getvalue()
print(len(data), [data.find(m.to_bytes(8, "little")) for m in markers])
for i in range(0, len(data), 16):
    print("    " + ", ".join(f"0x{b:02x}" for b in data[i : i + 16]) + ",")
