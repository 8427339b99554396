"""Transfer learning from Python on features a storage node extracts: the Python
twin of `cargo run --release --example train_head` (client/examples/train_head.rs).

EfficientNet-Lite0's first layers run at the node, the rest here; a softmax
(logistic-regression) head is trained in NumPy with Adam on the streamed features
of texture patches, one feature stream per epoch, then scored on held-out patches.

    bash scripts/setup-ml.sh                 # weights and texture patches
    csd serve --device emulated:mem --listen 127.0.0.1:50051 &
    python docs/examples/train_head.py --node grpc://127.0.0.1:50051 [--split auto]
"""

import argparse
import os
import time

import numpy as np

import csd


def softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


class SoftmaxHead:
    """Logistic regression over standardised features, Adam, one batch at a time."""

    def __init__(self, d, classes, lr=1e-2, wd=1e-2):
        self.w = np.zeros((d, classes), np.float32)
        self.b = np.zeros(classes, np.float32)
        self.lr, self.wd, self.t = lr, wd, 0
        self.m = [np.zeros_like(self.w), np.zeros_like(self.b)]
        self.v = [np.zeros_like(self.w), np.zeros_like(self.b)]
        self.mean = self.std = None

    def standardise(self, x):
        if self.mean is None:  # from the first batch, as a streaming job must
            self.mean, self.std = x.mean(0), x.std(0) + 1e-3
        return (x - self.mean) / self.std

    def step(self, x, y):
        x = self.standardise(x)
        p = softmax(x @ self.w + self.b)
        loss = -np.log(p[np.arange(len(y)), y] + 1e-9).mean()
        p[np.arange(len(y)), y] -= 1
        grads = [x.T @ p / len(y) + self.wd * self.w, p.mean(0)]
        self.t += 1
        for i, (param, g) in enumerate(zip((self.w, self.b), grads)):
            self.m[i] = 0.9 * self.m[i] + 0.1 * g
            self.v[i] = 0.999 * self.v[i] + 0.001 * g * g
            mh = self.m[i] / (1 - 0.9**self.t)
            vh = self.v[i] / (1 - 0.999**self.t)
            param -= self.lr * mh / (np.sqrt(vh) + 1e-8)
        return float(loss)

    def predict(self, x):
        return (self.standardise(x) @ self.w + self.b).argmax(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--node", default="grpc://127.0.0.1:50051")
    ap.add_argument("--home", default=os.environ.get("CSD_ML_HOME", os.path.expanduser("~/.cache/csd/ml")))
    ap.add_argument("--split", default="auto")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    weights = os.path.join(args.home, "efficientnet-lite0.safetensors")
    textures = os.path.join(args.home, "textures")
    if not os.path.isfile(weights):
        raise SystemExit(f"{weights} is missing: run bash scripts/setup-ml.sh first")
    for table, folder in (("textures_train", "train"), ("textures_test", "test")):
        n, classes = csd.put_images([args.node], table, os.path.join(textures, folder), partitions=2)
        print(f"stored {n} patches of {classes} as {table}")
    head, split = None, args.split
    for epoch in range(1, args.epochs + 1):
        started = time.monotonic()
        feats = csd.features([args.node], "textures_train", "efficientnet-lite0", weights=weights,
                             split=split, batch_size=args.batch, shuffle_buffer=4 * args.batch, seed=epoch)
        split = feats.split  # planned once, then kept
        losses = []
        for x, y in feats:
            if head is None:
                head = SoftmaxHead(x.shape[1], len(classes))
            losses.append(head.step(x, y))
        print(f"epoch {epoch}: {time.monotonic() - started:.2f} s, split {feats.split}, "
              f"{len(losses)} batches, mean loss {np.mean(losses):.4f}, {feats.bytes_received} bytes received")
    xs, ys = [], []
    for x, y in csd.features([args.node], "textures_test", "efficientnet-lite0", weights=weights, split=split):
        xs.append(x)
        ys.append(y)
    x, y = np.concatenate(xs), np.concatenate(ys)
    print(f"held-out accuracy {np.mean(head.predict(x) == y):.3f} on {len(y)} patches")


if __name__ == "__main__":
    main()
