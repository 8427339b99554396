#!/usr/bin/env python3
"""Writes EfficientNet-Lite0's feature extractor (stem .. global pool, 1280 floats per
image) as an ONNX model, from the same safetensors weights the Rust model loads, for
the ML bench's onnxruntime baseline. BatchNorm is folded into the convolutions here
(float64, then float32), as our Rust model folds it at load; padding is symmetric
(k // 2), as in our model and PyTorch's. Written from the architecture with onnx.helper:
no torch, no model hub.

Usage: effnet_lite0_onnx.py WEIGHTS.safetensors OUT.onnx
"""
import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "ml-pushdown", "tests", "reference"))
from effnet_lite0 import EPS, blocks, read_st  # noqa: E402  (the shared architecture walk)


def main(weights, out):
    W = {k: v.astype(np.float64) for k, v in read_st(weights).items() if v.dtype != np.int64}
    nodes, inits = [], []
    count = [0]

    def name(p):
        count[0] += 1
        return f"{p}_{count[0]}"

    def const(p, a):
        n = name(p)
        inits.append(numpy_helper.from_array(np.ascontiguousarray(a, dtype=np.float32), n))
        return n

    six = const("six", np.array(6.0))
    zero = const("zero", np.array(0.0))

    def conv_bn(x, conv, bnp, stride=1, groups=1, act=True):
        w = W[conv]
        g, b, m, v = (W[f"{bnp}.{k}"] for k in ("weight", "bias", "running_mean", "running_var"))
        scale = g / np.sqrt(v + EPS)
        wf = w * scale.reshape(-1, 1, 1, 1)
        bf = b - m * scale
        k = w.shape[2]
        y = name("conv")
        nodes.append(helper.make_node(
            "Conv", [x, const("w", wf), const("b", bf)], [y], kernel_shape=[k, k],
            strides=[stride, stride], pads=[k // 2] * 4, group=groups))
        if not act:
            return y
        z = name("relu6")
        nodes.append(helper.make_node("Clip", [y, zero, six], [z]))
        return z

    x = conv_bn("input", "_conv_stem.weight", "_bn0", stride=2)
    for p, stride, inp, cout, e in blocks():
        y = x
        if e != 1:
            y = conv_bn(y, p + "._expand_conv.weight", p + "._bn0")
        y = conv_bn(y, p + "._depthwise_conv.weight", p + "._bn1", stride, groups=inp * e)
        y = conv_bn(y, p + "._project_conv.weight", p + "._bn2", act=False)
        if stride == 1 and inp == cout:
            z = name("add")
            nodes.append(helper.make_node("Add", [y, x], [z]))
            y = z
        x = y
    x = conv_bn(x, "_conv_head.weight", "_bn1")
    pooled = name("pool")
    nodes.append(helper.make_node("GlobalAveragePool", [x], [pooled]))
    nodes.append(helper.make_node("Flatten", [pooled], ["features"], axis=1))
    graph = helper.make_graph(
        nodes, "efficientnet_lite0_features",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["n", 3, 224, 224])],
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["n", 1280])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
