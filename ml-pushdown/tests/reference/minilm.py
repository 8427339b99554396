#!/usr/bin/env python3
"""Independent numpy reference for all-MiniLM-L6-v2 (float64), with PyPI `tokenizers`.

Tokenises texts with the Hugging Face tokenizers wheel from the model's tokenizer.json,
runs a BERT encoder written from the architecture (Devlin et al.: post-LayerNorm,
exact-erf GELU, masked softmax attention) and sentence-transformers' pooling (mean over
the attention mask, L2 normalisation), and writes the token ids and every stage's output
in csd's stage layout, so a Rust test can compare them layer by layer:

  ids      [N, SEQ]          token ids, -1 after the last token
  stage.0  [N, SEQ, H + 1]   embeddings; last channel the mask; padded rows zero
  stage.k  [N, SEQ, H + 1]   after encoder layer k (1..6)
  stage.7  [N, H]            pooled, normalised sentence embedding

Padding is done the way Hugging Face does it (the whole SEQ with an additive mask), not
the way csd does it (only the sample's own tokens), so the two are checked against
each other too.

Usage: minilm.py WEIGHTS TOKENIZER_JSON TEXTS_JSON OUT.safetensors
"""
import json
import math
import sys

import numpy as np
from tokenizers import Tokenizer

sys.path.insert(0, __import__("os").path.dirname(__file__))
from effnet_lite0 import read_st, write_st  # noqa: E402

SEQ, H, HEADS, LAYERS, EPS = 128, 384, 12, 6, 1e-12


def layer_norm(x, g, b):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + EPS) * g + b


def erf(x):
    return np.vectorize(math.erf)(x)


def gelu(x):
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def lin(w, name, x):
    return x @ w[name + ".weight"].T + w[name + ".bias"]


def packed(h, mask):
    out = np.zeros((SEQ, H + 1))
    n = int(mask.sum())
    out[:n, :H] = h[:n]
    out[:n, H] = 1.0
    return out


def main():
    wpath, tpath, texts_path, out = sys.argv[1:5]
    w = {k: v.astype(np.float64) for k, v in read_st(wpath).items() if v.dtype != np.int64}
    tok = Tokenizer.from_file(tpath)
    tok.enable_truncation(SEQ)
    tok.enable_padding(length=SEQ, pad_id=0)
    texts = json.load(open(texts_path))
    stages = {f"stage.{i}": [] for i in range(LAYERS + 2)}
    ids_out = []
    for e in tok.encode_batch(texts):
        ids = np.array(e.ids)
        mask = np.array(e.attention_mask, dtype=np.float64)
        ids_out.append(np.where(mask > 0, ids, -1))
        x = (w["embeddings.word_embeddings.weight"][ids]
             + w["embeddings.position_embeddings.weight"][:SEQ]
             + w["embeddings.token_type_embeddings.weight"][np.array(e.type_ids)])
        x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        stages["stage.0"].append(packed(x, mask))
        additive = (1.0 - mask) * -1e9
        d = H // HEADS
        for i in range(LAYERS):
            p = f"encoder.layer.{i}"
            q, k, v = (lin(w, f"{p}.attention.self.{n}", x).reshape(SEQ, HEADS, d).transpose(1, 0, 2)
                       for n in ("query", "key", "value"))
            s = q @ k.transpose(0, 2, 1) / math.sqrt(d) + additive
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            ctx = (s @ v).transpose(1, 0, 2).reshape(SEQ, H)
            a = layer_norm(lin(w, f"{p}.attention.output.dense", ctx) + x,
                           w[f"{p}.attention.output.LayerNorm.weight"], w[f"{p}.attention.output.LayerNorm.bias"])
            f = lin(w, f"{p}.output.dense", gelu(lin(w, f"{p}.intermediate.dense", a)))
            x = layer_norm(f + a, w[f"{p}.output.LayerNorm.weight"], w[f"{p}.output.LayerNorm.bias"])
            stages[f"stage.{i + 1}"].append(packed(x, mask))
        pooled = (x * mask[:, None]).sum(0) / max(mask.sum(), 1e-9)
        stages[f"stage.{LAYERS + 1}"].append(pooled / max(np.linalg.norm(pooled), 1e-12))
    tensors = {k: np.stack(v) for k, v in stages.items()}
    tensors["ids"] = np.stack(ids_out).astype(np.float64)
    write_st(out, tensors)


if __name__ == "__main__":
    main()
