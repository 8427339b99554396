#!/usr/bin/env python3
"""Independent numpy reference for EfficientNet-Lite0 (float64, BatchNorm unfolded).

Reads the same safetensors weights as the Rust model, runs an input through every
stage and writes each stage's output to a safetensors file, so a Rust test can compare
layer by layer. Written from the architecture (Tan & Le, EfficientNet-Lite: ReLU6, no
squeeze-excite, fixed stem 32 / head 1280), not from the Rust code.

Usage: effnet_lite0.py WEIGHTS INPUT.safetensors OUT.safetensors [--padding same|sym]
INPUT holds one tensor "input" of shape [N, 3, H, W] (already normalised).
"""
import json
import struct
import sys

import numpy as np

EPS = 1e-3
STAGES = [(1, 3, 1, 1, 32, 16), (2, 3, 2, 6, 16, 24), (2, 5, 2, 6, 24, 40), (3, 3, 2, 6, 40, 80),
          (3, 5, 1, 6, 80, 112), (4, 5, 2, 6, 112, 192), (1, 3, 1, 6, 192, 320)]
DT = {"F32": np.float32, "F16": np.float16, "I64": np.int64}


def read_st(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        base = 8 + n
        buf = open(path, "rb").read()
    out = {}
    for k, v in head.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        out[k] = np.frombuffer(buf[base + a:base + b], dtype=DT[v["dtype"]]).reshape(v["shape"])
    return out


def write_st(path, tensors):
    header, blobs, off = {}, [], 0
    for k, a in tensors.items():
        raw = np.ascontiguousarray(a, dtype="<f4").tobytes()
        header[k] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def pad(x, k, s, mode):
    h, w = x.shape[2:]
    if mode == "sym":
        p = k // 2
        return np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
    ph = max((-(-h // s) - 1) * s + k - h, 0)
    pw = max((-(-w // s) - 1) * s + k - w, 0)
    return np.pad(x, ((0, 0), (0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2)))


def conv(x, w, s=1, groups=1, mode="same"):
    o, i_g, k, _ = w.shape
    x = pad(x, k, s, mode) if k > 1 else x
    n, c, h, wd = x.shape
    oh, ow = (h - k) // s + 1, (wd - k) // s + 1
    # patches: [n, c, k, k, oh, ow]
    cols = np.empty((n, c, k, k, oh, ow), dtype=x.dtype)
    for dy in range(k):
        for dx in range(k):
            cols[:, :, dy, dx] = x[:, :, dy:dy + s * oh:s, dx:dx + s * ow:s]
    if groups == 1:
        return np.einsum("nckluv,ockl->nouv", cols, w, optimize=True)
    assert groups == c == o
    return np.einsum("nckluv,ckl->ncuv", cols, w[:, 0], optimize=True)


def bn(x, W, p):
    g, b, m, v = (W[f"{p}.{n}"].astype(np.float64) for n in ("weight", "bias", "running_mean", "running_var"))
    sh = (1, -1, 1, 1)
    return (x - m.reshape(sh)) / np.sqrt(v.reshape(sh) + EPS) * g.reshape(sh) + b.reshape(sh)


def relu6(x):
    return np.clip(x, 0, 6)


def blocks():
    """The MBConv blocks in order: (weight prefix, stride, in, out channels, expansion)."""
    bi = 0
    for r, _k, s, e, cin, cout in STAGES:
        for j in range(r):
            yield f"_blocks.{bi}", (s if j == 0 else 1), (cin if j == 0 else cout), cout, e
            bi += 1


def forward(W, x, mode):
    W = {k: v.astype(np.float64) if v.dtype != np.int64 else v for k, v in W.items()}
    outs = {}
    x = relu6(bn(conv(x, W["_conv_stem.weight"], 2, mode=mode), W, "_bn0"))
    outs["stage.0"] = x
    bi = 0
    for p, stride, inp, cout, e in blocks():
        y = x
        if e != 1:
            y = relu6(bn(conv(y, W[p + "._expand_conv.weight"]), W, p + "._bn0"))
        y = relu6(bn(conv(y, W[p + "._depthwise_conv.weight"], stride, groups=y.shape[1], mode=mode), W, p + "._bn1"))
        y = bn(conv(y, W[p + "._project_conv.weight"]), W, p + "._bn2")
        if stride == 1 and inp == cout:
            y = y + x
        x = y
        bi += 1
        outs[f"stage.{bi}"] = x
    x = relu6(bn(conv(x, W["_conv_head.weight"]), W, "_bn1"))
    outs[f"stage.{bi + 1}"] = x
    x = x.mean(axis=(2, 3))
    outs[f"stage.{bi + 2}"] = x
    x = x @ W["_fc.weight"].T + W["_fc.bias"]
    outs[f"stage.{bi + 3}"] = x
    return outs


if __name__ == "__main__":
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    mode = sys.argv[5] if len(sys.argv) > 5 and sys.argv[4] == "--padding" else "same"
    W = read_st(sys.argv[1])
    x = read_st(sys.argv[2])["input"].astype(np.float64)
    write_st(sys.argv[3], forward(W, x, mode))
