#!/usr/bin/env python3
"""Writes small ONNX models of the graph shapes users bring, for the ONNX split tests:
a chain (ResNet-like, no skips), a residual and branching network (MobileNet-like:
inverted residuals and squeeze-excitation), a transformer encoder (MiniLM-like:
LayerNormalization, attention, GELU via Erf, constants for reshapes) and a model of
two inputs. Random weights from a fixed seed, written with onnx.helper: no torch, no
model hub. Every model takes a batch of any size (a named first dimension); image
models take 3x32x32 NCHW except `chain_nhwc`, which takes 32x32x3 NHWC, and
`chain_b1`, exported with a fixed batch of one.

Usage: onnx_test_models.py OUT_DIR
"""
import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

rng = np.random.default_rng(7)


class Graph:
    def __init__(self):
        self.nodes, self.inits, self.n = [], [], 0

    def name(self, p):
        self.n += 1
        return f"{p}_{self.n}"

    def const(self, p, a):
        n = self.name(p)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(a, dtype=np.float32), n))
        return n

    def op(self, op, inputs, p=None, **attrs):
        out = self.name(p or op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=out + "_node", **attrs))
        return out

    def conv(self, x, cin, cout, k=3, stride=1, groups=1):
        w = rng.normal(0, (2.0 / (cin // groups * k * k)) ** 0.5, (cout, cin // groups, k, k))
        b = rng.normal(0, 0.05, cout)
        return self.op("Conv", [x, self.const("w", w), self.const("b", b)], kernel_shape=[k, k],
                       strides=[stride, stride], pads=[k // 2] * 4, group=groups)

    def linear(self, x, din, dout):
        w = rng.normal(0, (1.0 / din) ** 0.5, (din, dout))
        return self.op("Add", [self.op("MatMul", [x, self.const("w", w)]),
                               self.const("b", rng.normal(0, 0.05, dout))])

    def save(self, path, inputs, outputs, opset=17):
        g = helper.make_graph(self.nodes, os.path.basename(path)[:-5], inputs, outputs, self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="csd-onnx-test-models")
        m.ir_version = 8
        onnx.checker.check_model(m)
        onnx.save(m, path)


def image_input(name="input", nhwc=False, batch="batch"):
    shape = [batch, 32, 32, 3] if nhwc else [batch, 3, 32, 32]
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def out(name, *dims, batch="batch"):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, [batch, *dims])


def chain(path, nhwc=False, batch="batch"):
    g = Graph()
    x = "input"
    if nhwc:
        x = g.op("Transpose", [x], perm=[0, 3, 1, 2])
    x = g.op("Relu", [g.conv(x, 3, 8, stride=2)])
    x = g.op("Relu", [g.conv(x, 8, 16, stride=2)])
    x = g.op("Relu", [g.conv(x, 16, 16)])
    x = g.op("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])
    x = g.op("GlobalAveragePool", [x])
    x = g.op("Flatten", [x], axis=1)
    w = rng.normal(0, 0.25, (10, 16))
    y = g.op("Gemm", [x, g.const("fc", w), g.const("fcb", rng.normal(0, 0.1, 10))], p="logits",
             transB=1)
    g.nodes[-1].output[0] = "logits"
    g.save(path, [image_input(nhwc=nhwc, batch=batch)], [out("logits", 10, batch=batch)])


def residual(path):
    g = Graph()
    x = g.op("Clip", [g.conv("input", 3, 16, stride=2), g.const("lo", np.array(0.0)),
                      g.const("hi", np.array(6.0))])
    for cin, e in ((16, 4), (16, 2)):
        y = g.op("Relu", [g.conv(x, cin, cin * e, k=1)])
        y = g.op("Relu", [g.conv(y, cin * e, cin * e, groups=cin * e)])
        s = g.op("GlobalAveragePool", [y])
        s = g.op("Relu", [g.conv(s, cin * e, 4, k=1)])
        s = g.op("Sigmoid", [g.conv(s, 4, cin * e, k=1)])
        y = g.op("Mul", [y, s])
        y = g.conv(y, cin * e, cin, k=1)
        x = g.op("Add", [x, y])
    # Two branches that meet again (an Inception-like block).
    a = g.op("Relu", [g.conv(x, 16, 8, k=1)])
    b = g.op("Relu", [g.conv(x, 16, 8, k=3)])
    x = g.op("Concat", [a, b], axis=1)
    x = g.op("GlobalAveragePool", [x])
    g.op("Flatten", [x], axis=1)
    g.nodes[-1].output[0] = "features"
    g.save(path, [image_input()], [out("features", 16)])


def transformer(path, tokens=8, d=16, heads=2, layers=2):
    g = Graph()
    x = "input"
    hd = d // heads
    shape_heads = g.op("Constant", [], p="shape", value=numpy_helper.from_array(
        np.array([0, tokens, heads, hd], dtype=np.int64)))
    shape_back = g.op("Constant", [], p="shape", value=numpy_helper.from_array(
        np.array([0, tokens, d], dtype=np.int64)))
    for _ in range(layers):
        def split_heads(t):
            return g.op("Transpose", [g.op("Reshape", [t, shape_heads])], perm=[0, 2, 1, 3])
        q, k, v = (split_heads(g.linear(x, d, d)) for _ in range(3))
        s = g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])])
        s = g.op("Softmax", [g.op("Mul", [s, g.const("scale", np.array(hd ** -0.5))])], axis=-1)
        a = g.op("Transpose", [g.op("MatMul", [s, v])], perm=[0, 2, 1, 3])
        a = g.linear(g.op("Reshape", [a, shape_back]), d, d)
        x = g.op("LayerNormalization", [g.op("Add", [x, a]), g.const("g", np.ones(d)),
                                        g.const("b", np.zeros(d))], axis=-1)
        h = g.linear(x, d, 2 * d)
        # GELU through Erf, as exporters write it below opset 20.
        e = g.op("Erf", [g.op("Div", [h, g.const("sqrt2", np.array(2 ** 0.5))])])
        h = g.op("Mul", [g.op("Mul", [h, g.const("half", np.array(0.5))]),
                         g.op("Add", [e, g.const("one", np.array(1.0))])])
        x = g.op("LayerNormalization", [g.op("Add", [x, g.linear(h, 2 * d, d)]),
                                        g.const("g", np.ones(d)), g.const("b", np.zeros(d))],
                 axis=-1)
    g.op("ReduceMean", [x], axes=[1], keepdims=0)
    g.nodes[-1].output[0] = "pooled"
    inp = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", tokens, d])
    g.save(path, [inp], [out("pooled", d)])


def two_inputs(path):
    g = Graph()
    x = g.op("Relu", [g.conv("input", 3, 8, stride=2)])
    x = g.op("Relu", [g.conv(x, 8, 8, stride=2)])
    x = g.op("Flatten", [g.op("GlobalAveragePool", [x])], axis=1)
    m = g.op("Relu", [g.linear("meta", 4, 8)])
    x = g.op("Concat", [x, m], axis=1)
    g.linear(x, 16, 5)
    g.nodes[-1].output[0] = "scores"
    meta = helper.make_tensor_value_info("meta", TensorProto.FLOAT, ["batch", 4])
    g.save(path, [image_input(), meta], [out("scores", 5)])


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    for name, write in (("chain", chain), ("residual", residual), ("transformer", transformer),
                        ("two_inputs", two_inputs)):
        write(os.path.join(out_dir, name + ".onnx"))
    chain(os.path.join(out_dir, "chain_nhwc.onnx"), nhwc=True)
    # Exported with a fixed batch of one, as many exporters write a model.
    chain(os.path.join(out_dir, "chain_b1.onnx"), batch=1)


if __name__ == "__main__":
    main(sys.argv[1])
