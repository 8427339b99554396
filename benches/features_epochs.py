"""Epochs of a feature stream through the Python package against the Rust path a
Python user has without it: `csd features --out FILE.parquet` (a separate process)
and the file read into NumPy. Same node, dataset, model and split; medians of
`--repeat` runs, side by side in one run.

    python benches/features_epochs.py --node grpc://127.0.0.1:50051 \
        --images ~/.cache/csd/ml/textures/train --weights ~/.cache/csd/ml/efficientnet-lite0.safetensors \
        --csd target/debug/csd [--split 3] [--epochs 3] [--repeat 3]

Needs the package importable (`pip install ./client/python`, or the built
extension on PYTHONPATH as tests/python.rs lays it out).
"""

import argparse
import os
import statistics
import subprocess
import tempfile
import time

import numpy as np
import pyarrow.parquet as pq

import csd


def consume(batches):
    """What a training loop does with a batch at the least: touch every value."""
    n, s = 0, 0.0
    for x, y in batches:
        n += len(y)
        s += float(x.sum())
    return n


def cli_epoch(args, out):
    started = time.monotonic()
    subprocess.run(
        [args.csd, "features", "--node", args.node, "--dataset", "bench_imgs", "--model", "efficientnet-lite0",
         "--weights", args.weights, "--split", str(args.split), "--batch", str(args.batch), "--out", out],
        check=True, capture_output=True,
    )
    t = pq.read_table(out)
    x = t.column("features").combine_chunks().flatten().to_numpy().reshape(t.num_rows, -1)
    y = t.column("label").to_numpy()
    consume([(x[i : i + args.batch], y[i : i + args.batch]) for i in range(0, len(y), args.batch)])
    return time.monotonic() - started


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--node", required=True)
    ap.add_argument("--images", required=True)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--csd", required=True)
    ap.add_argument("--split", default="3")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n, _ = csd.put_images([args.node], "bench_imgs", args.images, partitions=2)
    times = {"csd features + parquet": [], "python package": [], "python package, kept, epoch 2+": []}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "f.parquet")
        for _ in range(args.repeat):
            times["csd features + parquet"].append(cli_epoch(args, out))
            started = time.monotonic()
            got = consume(csd.features([args.node], "bench_imgs", "efficientnet-lite0", weights=args.weights,
                                       split=args.split, batch_size=args.batch))
            times["python package"].append(time.monotonic() - started)
            assert got == n
            with csd.epochs([args.node], "bench_imgs", "efficientnet-lite0", weights=args.weights,
                            split=args.split, batch_size=args.batch, keep=True, ttl=600) as run:
                consume(run.epoch())
                for _ in range(args.epochs - 1):
                    started = time.monotonic()
                    assert consume(run.epoch()) == n
                    times["python package, kept, epoch 2+"].append(time.monotonic() - started)
    base = statistics.median(times["csd features + parquet"])
    print(f"{n} samples, efficientnet-lite0 split {args.split}, batch {args.batch}; medians of {args.repeat}")
    for k, v in times.items():
        m = statistics.median(v)
        print(f"  {k:34s} {m:7.3f} s   {m / base:5.2f}x the csd features path   (runs: {', '.join(f'{t:.3f}' for t in v)})")


if __name__ == "__main__":
    main()
