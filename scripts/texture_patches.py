#!/usr/bin/env python3
"""Cuts scikit-image's texture images (brick, grass, gravel) into patches for a
transfer-learning test: train patches come from the left 60% of each texture, test
patches from the right 40%, so no test pixel was seen in training.

Writes OUT/{train,test}/<class>/<n>.png and OUT/labels.csv (file,class,split).
Usage: texture_patches.py OUT [--patch 96] [--per-class 40]
"""
import argparse
import os

import numpy as np
from skimage import data, io

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--patch", type=int, default=96)
ap.add_argument("--per-class", type=int, default=40)
a = ap.parse_args()
rng = np.random.default_rng(7)
rows = ["file,class,split"]
for name in ["brick", "grass", "gravel"]:
    img = getattr(data, name)()
    if img.ndim == 2:
        img = np.stack([img] * 3, axis=-1)
    h, w = img.shape[:2]
    cut = int(w * 0.6)
    for split, (lo, hi), n in [("train", (0, cut), int(a.per_class * 0.6)), ("test", (cut, w), a.per_class - int(a.per_class * 0.6))]:
        d = os.path.join(a.out, split, name)
        os.makedirs(d, exist_ok=True)
        for i in range(n):
            y = rng.integers(0, h - a.patch)
            x = rng.integers(lo, hi - a.patch)
            f = os.path.join(split, name, f"{i}.png")
            io.imsave(os.path.join(a.out, f), img[y:y + a.patch, x:x + a.patch].astype(np.uint8), check_contrast=False)
            rows.append(f"{f},{name},{split}")
open(os.path.join(a.out, "labels.csv"), "w").write("\n".join(rows) + "\n")
print(f"{len(rows) - 1} patches in {a.out}")
