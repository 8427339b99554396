"""Epochs of a feature stream through the Python package against the Rust path a
Python user has without it: `csd features --out FILE.parquet` (a separate process)
and the file read into NumPy. Same node, dataset, model and split; medians of
`--repeat` runs, side by side in one run.

    python benches/features_epochs.py --node grpc://127.0.0.1:50051 \
        --images ~/.cache/csd/ml/textures/train --weights ~/.cache/csd/ml/efficientnet-lite0.safetensors \
        --csd target/debug/csd [--split 3] [--epochs 3] [--repeat 3] [--torch-url http://HOST:PORT]

`scripts/bench-python.sh` runs it against a node behind a tc-shaped veth, with the
images served over HTTP from the node's side for the plain-PyTorch baseline.

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
    """`csd features` into a Parquet file, then the file read as a loop would."""
    subprocess.run(
        [args.csd, "features", "--node", args.node, "--dataset", "bench_imgs", "--model", "efficientnet-lite0",
         "--weights", args.weights, "--split", str(args.split), "--batch", str(args.batch), "--out", out],
        check=True, capture_output=True,
    )
    t = pq.read_table(out)
    x = t.column("features").combine_chunks().flatten().to_numpy().reshape(t.num_rows, -1)
    y = t.column("label").to_numpy()
    return consume([(x[i : i + args.batch], y[i : i + args.batch]) for i in range(0, len(y), args.batch)])


def rx(veth):
    """Bytes `veth` has received (0 when none is named)."""
    if veth is None:
        return 0
    with open(f"/sys/class/net/{veth}/statistics/rx_bytes") as f:
        return int(f.read())


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
    ap.add_argument("--torch-url", help="where --images is served over HTTP: adds plain PyTorch reading the raw "
                    "images and running the whole feature extractor here (HAPI's baseline; needs torch)")
    ap.add_argument("--workers", type=int, default=2, help="the baseline's DataLoader workers")
    ap.add_argument("--veth", help="count the bytes this network device receives during each run")
    args = ap.parse_args()
    n, _ = csd.put_images([args.node], "bench_imgs", args.images, partitions=2)
    rows = {}  # name: [(seconds, bytes received)]

    def measure(name, epoch):
        before, started = rx(args.veth), time.monotonic()
        got = epoch()
        took = time.monotonic() - started
        if name is not None:
            rows.setdefault(name, []).append((took, rx(args.veth) - before))
        assert got == n, (name, got, n)

    torch_epoch = None
    if args.torch_url:
        import torch_baseline

        torch_epoch = torch_baseline.epochs(args.images, args.torch_url, args.weights, args.batch, args.workers)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "f.parquet")
        for _ in range(args.repeat):
            measure(f"csd features --split {args.split} + parquet", lambda: cli_epoch(args, out))
            measure(f"python package, split {args.split}",
                    lambda: consume(csd.features([args.node], "bench_imgs", "efficientnet-lite0",
                                                 weights=args.weights, split=args.split, batch_size=args.batch)))
            for split in dict.fromkeys([args.split, "auto"]):
                with csd.epochs([args.node], "bench_imgs", "efficientnet-lite0", weights=args.weights,
                                split=split, batch_size=args.batch, keep=True, ttl=600) as run:
                    # A fixed split's first epoch is the row above.
                    measure("python package, split auto, epoch 1" if split == "auto" else None,
                            lambda: consume(run.epoch()))
                    for _ in range(args.epochs - 1):
                        measure(f"python package, split {split}, kept, epoch 2+", lambda: consume(run.epoch()))
            if torch_epoch is not None:
                for e in range(args.epochs):
                    measure("plain PyTorch, raw images" + (", epoch 1" if e == 0 else ", epoch 2+"),
                            lambda: consume(torch_epoch()))
    base = statistics.median(t for t, _ in rows[f"csd features --split {args.split} + parquet"])
    print(f"{n} samples, efficientnet-lite0, batch {args.batch}; medians of {args.repeat} runs "
          f"({args.epochs - 1} later epochs each)")
    for k, v in rows.items():
        m = statistics.median(t for t, _ in v)
        mb = statistics.median(b for _, b in v) / 1e6
        print(f"  {k:44s} {m:7.3f} s  {mb:8.2f} MB  {m / base:5.2f}x the csd features path   "
              f"(runs: {', '.join(f'{t:.3f}' for t, _ in v)})")


if __name__ == "__main__":
    main()
