#!/usr/bin/env python3
"""onnxruntime's rate for an ONNX feature extractor: the ML bench's baseline.

Runs batches of the given size for about `seconds` (after two warm-up batches) with
`threads` intra-op threads and prints one JSON line: images/s and the features of a
fixed input (so the caller can check that both sides computed the same thing).

Usage: ml_ort.py MODEL.onnx INPUT.npy --threads N --batch B --seconds S
INPUT.npy: float32 [B, 3, 224, 224], already normalised.
"""
import argparse
import json
import time

import numpy as np
import onnxruntime as ort


def rate_args(*inputs):
    """The command line the baselines share: the model, `inputs`, threads, batch, seconds."""
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    for name in inputs:
        ap.add_argument(name)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=5.0)
    return ap.parse_args()


def session(model, threads):
    """A CPU session as csd runs one: `threads` intra-op threads, sequential, all
    graph optimisations."""
    o = ort.SessionOptions()
    o.intra_op_num_threads = threads
    o.inter_op_num_threads = 1
    o.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model, o, providers=["CPUExecutionProvider"])


def main():
    a = rate_args("input")
    s = session(a.model, a.threads)
    x = np.load(a.input).astype(np.float32)
    assert x.shape[0] == a.batch, f"input has {x.shape[0]} rows, --batch is {a.batch}"
    for _ in range(2):
        y = s.run(None, {"input": x})[0]
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < a.seconds:
        s.run(None, {"input": x})
        n += a.batch
    dt = time.perf_counter() - t0
    print(json.dumps({
        "images_per_s": n / dt,
        "images": n,
        "seconds": dt,
        "threads": a.threads,
        "batch": a.batch,
        "onnxruntime": ort.__version__,
        "features": y.astype(float).tolist(),
    }))


if __name__ == "__main__":
    main()
