#!/usr/bin/env python3
"""Writes a ResNet (18 or 50; torchvision's layout, v1.5 strides) feature extractor as
ONNX: stem .. global average pool, flattened (512 or 2048 floats per 224x224 image).
Random He-initialised weights from a fixed seed with BatchNorm folded into each
convolution's bias, as an export of a trained model would be after constant folding:
the bench times the graph, not the weights. Written with onnx.helper: no torch, no
model hub.

Usage: resnet_onnx.py {18|50} OUT.onnx
"""
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

rng = np.random.default_rng(50)


def main(depth, out):
    nodes, inits = [], []
    count = [0]

    def name(p):
        count[0] += 1
        return f"{p}_{count[0]}"

    def const(p, a):
        n = name(p)
        inits.append(numpy_helper.from_array(np.ascontiguousarray(a, dtype=np.float32), n))
        return n

    def conv(x, cin, cout, k, stride=1, relu=True):
        w = rng.normal(0, (2.0 / (cin * k * k)) ** 0.5, (cout, cin, k, k))
        y = name("conv")
        nodes.append(helper.make_node(
            "Conv", [x, const("w", w), const("b", rng.normal(0, 0.01, cout))], [y],
            kernel_shape=[k, k], strides=[stride, stride], pads=[k // 2] * 4))
        if not relu:
            return y
        z = name("relu")
        nodes.append(helper.make_node("Relu", [y], [z]))
        return z

    def add_relu(a, b):
        s, r = name("add"), name("relu")
        nodes.append(helper.make_node("Add", [a, b], [s]))
        nodes.append(helper.make_node("Relu", [s], [r]))
        return r

    x = conv("input", 3, 64, 7, stride=2)
    y = name("maxpool")
    nodes.append(helper.make_node("MaxPool", [x], [y], kernel_shape=[3, 3], strides=[2, 2],
                                  pads=[1, 1, 1, 1]))
    x, cin = y, 64
    blocks = {18: [2, 2, 2, 2], 50: [3, 4, 6, 3]}[depth]
    bottleneck = depth >= 50
    for stage, n in enumerate(blocks):
        width = 64 * 2 ** stage
        cout = width * 4 if bottleneck else width
        for b in range(n):
            stride = 2 if stage > 0 and b == 0 else 1
            if bottleneck:
                h = conv(x, cin, width, 1)
                h = conv(h, width, width, 3, stride)
                h = conv(h, width, cout, 1, relu=False)
            else:
                h = conv(x, cin, width, 3, stride)
                h = conv(h, width, width, 3, relu=False)
            skip = conv(x, cin, cout, 1, stride, relu=False) if (stride != 1 or cin != cout) else x
            x, cin = add_relu(h, skip), cout
    p = name("pool")
    nodes.append(helper.make_node("GlobalAveragePool", [x], [p]))
    nodes.append(helper.make_node("Flatten", [p], ["features"], axis=1))
    g = helper.make_graph(
        nodes, f"resnet{depth}_features",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 224, 224])],
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", cin])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                          producer_name="csd-resnet-onnx")
    m.ir_version = 8
    onnx.checker.check_model(m)
    onnx.save(m, out)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
