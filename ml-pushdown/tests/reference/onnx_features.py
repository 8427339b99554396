#!/usr/bin/env python3
"""The reference for csd's ONNX features: the whole model on onnxruntime in Python,
on images decoded with Pillow (resized, bilinear, only when their size differs from
the model's input), scaled to [0, 1], normalised by MEAN and STD per channel.

Usage: onnx_features.py MODEL.onnx IMAGE_DIR OUT.json [MEAN STD]
  MEAN, STD: "r,g,b" (defaults 0,0,0 and 1,1,1)
Writes {"relative/path.png": [floats of the model's first output, flattened]}.
"""
import json
import os
import sys

import numpy as np
import onnxruntime as ort
from PIL import Image


def main(model, image_dir, out, mean="0,0,0", std="1,1,1"):
    mean = np.array([float(x) for x in mean.split(",")], dtype=np.float32)
    std = np.array([float(x) for x in std.split(",")], dtype=np.float32)
    s = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    inp = s.get_inputs()[0]
    channels_last = inp.shape[-1] == 3
    h, w = (inp.shape[1], inp.shape[2]) if channels_last else (inp.shape[2], inp.shape[3])
    found = {}
    for root, _, files in os.walk(image_dir):
        for f in sorted(files):
            if not f.lower().endswith((".png", ".jpg", ".jpeg")):
                continue
            path = os.path.join(root, f)
            img = Image.open(path).convert("RGB")
            if img.size != (w, h):
                img = img.resize((w, h), Image.BILINEAR)
            x = (np.asarray(img, dtype=np.float32) / 255.0 - mean) / std
            if not channels_last:
                x = x.transpose(2, 0, 1)
            y = s.run(None, {inp.name: x[None].astype(np.float32)})[0]
            found[os.path.relpath(path, image_dir)] = y.reshape(-1).astype(float).tolist()
    with open(out, "w") as fh:
        json.dump(found, fh)


if __name__ == "__main__":
    main(*sys.argv[1:])
