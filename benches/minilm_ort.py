#!/usr/bin/env python3
"""onnxruntime's rate for all-MiniLM-L6-v2 as a user runs it: the `minilm` bench's
baseline.

Tokenises the texts with the model's own tokenizer.json (the `tokenizers` wheel; cut at
128 tokens), then runs batches of `batch` texts padded to the batch's longest text (as
Hugging Face pipelines do), then each text alone (no padding work), each for about
`seconds` after one warm-up pass, with `threads` intra-op threads. Prints one JSON
line: texts/s both ways (tokenising included) and the embeddings of the first
`batch` texts.

Usage: minilm_ort.py MODEL.onnx TOKENIZER.json TEXTS.json --threads N --batch B --seconds S
"""
import json
import os
import sys
import time

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(__file__))
from ml_ort import rate_args, session  # noqa: E402  (the baselines' shared session)


def main():
    a = rate_args("tokenizer", "texts")
    s = session(a.model, a.threads)
    tok = Tokenizer.from_file(a.tokenizer)
    tok.enable_truncation(128)
    tok.enable_padding(pad_id=0)
    texts = json.load(open(a.texts))
    batches = [texts[i:i + a.batch] for i in range(0, len(texts), a.batch)]

    def run(batch):
        enc = tok.encode_batch(batch)
        ids = np.array([e.ids for e in enc], dtype=np.int64)
        mask = np.array([e.attention_mask for e in enc], dtype=np.int64)
        return s.run(None, {"input_ids": ids, "attention_mask": mask})[0]

    def rate(groups):
        for g in groups:
            run(g)
        n, i, t0 = 0, 0, time.perf_counter()
        while time.perf_counter() - t0 < a.seconds:
            g = groups[i % len(groups)]
            run(g)
            n += len(g)
            i += 1
        return n / (time.perf_counter() - t0)

    first = run(batches[0])
    padded = rate(batches)
    # Each text alone: no padding work, as csd runs a text on its own token count.
    alone = rate([[t] for t in texts])
    print(json.dumps({
        "texts_per_s": padded,
        "texts_per_s_one_at_a_time": alone,
        "threads": a.threads,
        "batch": a.batch,
        "onnxruntime": ort.__version__,
        "features": first.astype(float).tolist(),
    }))


if __name__ == "__main__":
    main()
