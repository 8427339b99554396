#!/usr/bin/env python3
"""Writes all-MiniLM-L6-v2 (token ids to its normalised sentence embedding, 384 floats)
as an ONNX model, from the same safetensors weights csd's BERT loads, so that csd's
own transformer can be measured against onnxruntime on the same weights. Written from
the architecture with onnx.helper (post-LayerNorm BERT, exact-erf GELU, masked softmax
attention, sentence-transformers' mean pooling and L2 normalisation): no torch, no
model hub. Batch and sequence length are dynamic.

Inputs: input_ids int64 [N, T], attention_mask int64 [N, T]. Output: embedding [N, 384].

Usage: minilm_onnx.py WEIGHTS.safetensors OUT.onnx
"""
import math
import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "ml-pushdown", "tests", "reference"))
from effnet_lite0 import read_st  # noqa: E402  (the safetensors reader the references share)

H, HEADS, LAYERS, EPS = 384, 12, 6, 1e-12


def main(weights, out):
    W = {k: v.astype(np.float32) for k, v in read_st(weights).items() if v.dtype != np.int64}
    nodes, inits = [], []
    count = [0]

    def fresh(p):
        count[0] += 1
        return f"{p}_{count[0]}"

    def const(p, a, dtype=np.float32):
        n = fresh(p)
        inits.append(numpy_helper.from_array(np.asarray(a, dtype=dtype), n))
        return n

    def op(kind, ins, prefix=None, **attrs):
        o = fresh(prefix or kind.lower())
        nodes.append(helper.make_node(kind, ins, [o], name=fresh(kind), **attrs))
        return o

    def linear(x, name):
        w = const("w", W[name + ".weight"].T)
        return op("Add", [op("MatMul", [x, w]), const("b", W[name + ".bias"])])

    def norm(x, name):
        return op("LayerNormalization", [x, const("g", W[name + ".weight"]), const("b", W[name + ".bias"])],
                  axis=-1, epsilon=EPS)

    d = H // HEADS
    ids, mask = "input_ids", "attention_mask"
    words = op("Gather", [const("word_embeddings", W["embeddings.word_embeddings.weight"]), ids])
    length = op("Gather", [op("Shape", [ids]), const("one", [1], np.int64)], axis=0)
    positions = op("Slice", [const("position_embeddings", W["embeddings.position_embeddings.weight"]),
                             const("zero", [0], np.int64), length, const("axis", [0], np.int64)])
    token_type = const("token_type", W["embeddings.token_type_embeddings.weight"][0])
    x = norm(op("Add", [op("Add", [words, positions]), token_type]), "embeddings.LayerNorm")
    m = op("Cast", [mask], to=TensorProto.FLOAT)
    additive = op("Mul", [op("Sub", [const("one_f", 1.0), m]), const("neg", -1e9)])
    additive = op("Unsqueeze", [additive, const("axes", [1, 2], np.int64)])
    heads = const("heads", [0, 0, HEADS, d], np.int64)
    for i in range(LAYERS):
        p = f"encoder.layer.{i}"
        q, k, v = (op("Reshape", [linear(x, f"{p}.attention.self.{n}"), heads]) for n in ("query", "key", "value"))
        q = op("Transpose", [q], perm=[0, 2, 1, 3])
        k = op("Transpose", [k], perm=[0, 2, 3, 1])
        v = op("Transpose", [v], perm=[0, 2, 1, 3])
        s = op("Add", [op("Div", [op("MatMul", [q, k]), const("scale", math.sqrt(d))]), additive])
        ctx = op("MatMul", [op("Softmax", [s], axis=-1), v])
        ctx = op("Reshape", [op("Transpose", [ctx], perm=[0, 2, 1, 3]), const("hidden", [0, 0, H], np.int64)])
        a = norm(op("Add", [linear(ctx, f"{p}.attention.output.dense"), x]), f"{p}.attention.output.LayerNorm")
        h = linear(a, f"{p}.intermediate.dense")
        gelu = op("Mul", [op("Mul", [h, const("half", 0.5)]),
                          op("Add", [op("Erf", [op("Div", [h, const("sqrt2", math.sqrt(2.0))])]), const("one_f", 1.0)])])
        x = norm(op("Add", [linear(gelu, f"{p}.output.dense"), a]), f"{p}.output.LayerNorm")
    m3 = op("Unsqueeze", [m, const("axes", [2], np.int64)])
    summed = op("ReduceSum", [op("Mul", [x, m3]), const("axes", [1], np.int64)], keepdims=0)
    count_ = op("Max", [op("ReduceSum", [m3, const("axes", [1], np.int64)], keepdims=0), const("tiny", 1e-9)])
    pooled = op("Div", [summed, count_])
    length2 = op("ReduceL2", [pooled], axes=[1], keepdims=1)
    nodes.append(helper.make_node("Div", [pooled, op("Max", [length2, const("eps", 1e-12)])], ["embedding"], name="out"))
    graph = helper.make_graph(
        nodes, "minilm-l6",
        [helper.make_tensor_value_info(ids, TensorProto.INT64, ["N", "T"]),
         helper.make_tensor_value_info(mask, TensorProto.INT64, ["N", "T"])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["N", H])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
