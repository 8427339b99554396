#!/usr/bin/env python3
"""What a user of onnxruntime alone gets from an ONNX image model: the onnx bench's
node-rate baseline. Decodes the images with Pillow (resized, bilinear, only when their
size differs from the model's input), scales to [0, 1], normalises, runs batches with
`threads` intra-op threads, for about `seconds` after one warm-up batch; prints one
JSON line: images/s end to end (decode included) and of the model alone.

Usage: onnx_rate.py MODEL.onnx IMAGE_DIR --threads N --batch B --seconds S [--mean r,g,b --std r,g,b]
"""
import argparse
import json
import os
import time

import numpy as np
import onnxruntime as ort
from PIL import Image


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("images")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--mean", default="0,0,0")
    ap.add_argument("--std", default="1,1,1")
    a = ap.parse_args()
    mean = np.array([float(x) for x in a.mean.split(",")], dtype=np.float32)
    std = np.array([float(x) for x in a.std.split(",")], dtype=np.float32)
    o = ort.SessionOptions()
    o.intra_op_num_threads = a.threads
    o.inter_op_num_threads = 1
    o.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    o.add_session_config_entry("session.intra_op.allow_spinning", "0")
    s = ort.InferenceSession(a.model, o, providers=["CPUExecutionProvider"])
    inp = s.get_inputs()[0]
    h, w = inp.shape[2], inp.shape[3]
    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(a.images) for f in fs
                   if f.lower().endswith((".png", ".jpg", ".jpeg")))
    blobs = [open(f, "rb").read() for f in files]

    def decode(b):
        import io
        img = Image.open(io.BytesIO(b)).convert("RGB")
        if img.size != (w, h):
            img = img.resize((w, h), Image.BILINEAR)
        return ((np.asarray(img, dtype=np.float32) / 255.0 - mean) / std).transpose(2, 0, 1)

    def batches():
        i = 0
        while True:
            yield np.stack([decode(blobs[(i + k) % len(blobs)]) for k in range(a.batch)])
            i += a.batch

    gen = batches()
    s.run(None, {inp.name: next(gen)})
    n, model_s, t0 = 0, 0.0, time.perf_counter()
    while time.perf_counter() - t0 < a.seconds:
        x = next(gen)
        t = time.perf_counter()
        s.run(None, {inp.name: x})
        model_s += time.perf_counter() - t
        n += a.batch
    dt = time.perf_counter() - t0
    print(json.dumps({
        "images_per_s": n / dt,
        "model_images_per_s": n / model_s,
        "images": n,
        "threads": a.threads,
        "batch": a.batch,
        "onnxruntime": ort.__version__,
    }))


if __name__ == "__main__":
    main()
