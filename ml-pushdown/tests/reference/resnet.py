#!/usr/bin/env python3
"""Independent numpy reference for ResNet-18/50 (float64, BatchNorm unfolded).

Writes random weights under torchvision's names (He-initialised convolutions, random
batch-norm statistics, a random classifier), runs an input through every stage (stem =
conv1 + bn1 + ReLU + 3x3/2 max pool; one stage per residual block; global average
pool; then the classifier) and writes each stage's output, so a Rust test can compare
layer by layer. Written from the architecture (He et al.; torchvision puts a
bottleneck's stride on its 3x3), not from the Rust code.

Usage: resnet.py 18|50 WEIGHTS_OUT INPUT.safetensors OUT.safetensors [--seed N]
INPUT holds one tensor "input" of shape [N, 3, H, W].
"""
import sys

import numpy as np

from effnet_lite0 import conv as effnet_conv, read_st, write_st

EPS = 1e-5
CONFIG = {18: ("basic", [2, 2, 2, 2], 1), 50: ("bottleneck", [3, 4, 6, 3], 4)}


def conv(x, w, s=1):
    """Convolution with symmetric zero padding k // 2 (torchvision's)."""
    return effnet_conv(x, w, s, mode="sym")


def bn(x, W, p):
    g, b, m, v = (W[f"{p}.{n}"] for n in ("weight", "bias", "running_mean", "running_var"))
    sh = (1, -1, 1, 1)
    return (x - m.reshape(sh)) / np.sqrt(v.reshape(sh) + EPS) * g.reshape(sh) + b.reshape(sh)


def max_pool(x, k=3, s=2):
    p = k // 2
    x = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)), constant_values=-np.inf)
    n, c, h, w = x.shape
    oh, ow = (h - k) // s + 1, (w - k) // s + 1
    out = np.full((n, c, oh, ow), -np.inf)
    for dy in range(k):
        for dx in range(k):
            out = np.maximum(out, x[:, :, dy:dy + s * oh:s, dx:dx + s * ow:s])
    return out


def blocks(depth):
    """(prefix, kind, in, width, out, stride, has_downsample) per residual block."""
    kind, counts, exp = CONFIG[depth]
    cin = 64
    for li, (n, width) in enumerate(zip(counts, [64, 128, 256, 512])):
        for r in range(n):
            s = 2 if r == 0 and li > 0 else 1
            cout = width * exp
            yield f"layer{li + 1}.{r}", kind, cin, width, cout, s, (s != 1 or cin != cout)
            cin = cout


def random_weights(depth, rng):
    W = {}

    def conv_bn(name, bn_name, cout, cin, k):
        W[f"{name}.weight"] = rng.standard_normal((cout, cin, k, k)) * np.sqrt(2.0 / (cin * k * k))
        W[f"{bn_name}.weight"] = rng.uniform(0.5, 1.0, cout)
        W[f"{bn_name}.bias"] = rng.standard_normal(cout) * 0.1
        W[f"{bn_name}.running_mean"] = rng.standard_normal(cout) * 0.1
        W[f"{bn_name}.running_var"] = rng.uniform(0.5, 1.5, cout)

    conv_bn("conv1", "bn1", 64, 3, 7)
    for p, kind, cin, width, cout, _s, down in blocks(depth):
        if kind == "basic":
            conv_bn(f"{p}.conv1", f"{p}.bn1", width, cin, 3)
            conv_bn(f"{p}.conv2", f"{p}.bn2", width, width, 3)
        else:
            conv_bn(f"{p}.conv1", f"{p}.bn1", width, cin, 1)
            conv_bn(f"{p}.conv2", f"{p}.bn2", width, width, 3)
            conv_bn(f"{p}.conv3", f"{p}.bn3", cout, width, 1)
        if down:
            conv_bn(f"{p}.downsample.0", f"{p}.downsample.1", cout, cin, 1)
    feat = 512 * CONFIG[depth][2]
    W["fc.weight"] = rng.standard_normal((1000, feat)) / np.sqrt(feat)
    W["fc.bias"] = rng.standard_normal(1000) * 0.01
    # Stored as float32: the reference runs on exactly the weights the model reads.
    return {k: v.astype(np.float32).astype(np.float64) for k, v in W.items()}


def forward(depth, W, x):
    relu = lambda t: np.maximum(t, 0)
    outs = {}
    x = max_pool(relu(bn(conv(x, W["conv1.weight"], 2), W, "bn1")))
    outs["stage.0"] = x
    i = 0
    for p, kind, _cin, _w, _cout, s, down in blocks(depth):
        if kind == "basic":
            y = relu(bn(conv(x, W[f"{p}.conv1.weight"], s), W, f"{p}.bn1"))
            y = bn(conv(y, W[f"{p}.conv2.weight"]), W, f"{p}.bn2")
        else:
            y = relu(bn(conv(x, W[f"{p}.conv1.weight"]), W, f"{p}.bn1"))
            y = relu(bn(conv(y, W[f"{p}.conv2.weight"], s), W, f"{p}.bn2"))
            y = bn(conv(y, W[f"{p}.conv3.weight"]), W, f"{p}.bn3")
        short = bn(conv(x, W[f"{p}.downsample.0.weight"], s), W, f"{p}.downsample.1") if down else x
        x = relu(y + short)
        i += 1
        outs[f"stage.{i}"] = x
    x = x.mean(axis=(2, 3))
    outs[f"stage.{i + 1}"] = x
    outs[f"stage.{i + 2}"] = x @ W["fc.weight"].T + W["fc.bias"]
    return outs


if __name__ == "__main__":
    if len(sys.argv) < 5:
        raise SystemExit(__doc__)
    depth = int(sys.argv[1])
    seed = int(sys.argv[6]) if len(sys.argv) > 6 and sys.argv[5] == "--seed" else 0
    W = random_weights(depth, np.random.default_rng(seed))
    write_st(sys.argv[2], W)
    x = read_st(sys.argv[3])["input"].astype(np.float64)
    write_st(sys.argv[4], forward(depth, W, x))
