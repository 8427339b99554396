"""Transfer learning in PyTorch on features a storage node extracts: the PyTorch
twin of `docs/examples/train_head.py` (NumPy) and of `cargo run --release --example
train_head` (client/examples/train_head.rs).

EfficientNet-Lite0's first layers run at the node, the rest here; `csd.torch_dataset`
streams the features into a `DataLoader`, and a linear (softmax) head is trained with
Adam, then scored on held-out patches. With `--keep`, the node keeps its output of
the first epoch and later epochs read it back.

    bash scripts/setup-ml.sh                 # weights and texture patches
    pip install torch
    csd serve --device emulated:mem --listen 127.0.0.1:50051 &
    python docs/examples/train_head_torch.py --node grpc://127.0.0.1:50051 [--split auto] [--keep]
"""

import argparse
import os
import time

import torch
from torch.utils.data import DataLoader

import csd


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--node", default="grpc://127.0.0.1:50051")
    ap.add_argument("--home", default=os.environ.get("CSD_ML_HOME", os.path.expanduser("~/.cache/csd/ml")))
    ap.add_argument("--split", default="auto")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--keep", action="store_true", help="keep the node's output between epochs")
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = os.path.join(args.home, "efficientnet-lite0.safetensors")
    textures = os.path.join(args.home, "textures")
    if not os.path.isfile(weights):
        raise SystemExit(f"{weights} is missing: run bash scripts/setup-ml.sh first")
    for table, folder in (("textures_train", "train"), ("textures_test", "test")):
        n, classes = csd.put_images([args.node], table, os.path.join(textures, folder), partitions=2)
        print(f"stored {n} patches of {classes} as {table}")

    train = csd.torch_dataset([args.node], "textures_train", "efficientnet-lite0", weights=weights,
                              split=args.split, batch_size=args.batch, shuffle_buffer=4 * args.batch,
                              seed=1, keep=args.keep)
    head, mean, std, opt = None, None, None, None
    with train:
        for epoch in range(1, args.epochs + 1):
            started = time.monotonic()
            losses = []
            for x, y in DataLoader(train, batch_size=None):  # items are batches already
                if head is None:
                    # Standardised from the first batch, as a streaming job must.
                    mean, std = x.mean(0), x.std(0, unbiased=False) + 1e-3
                    head = torch.nn.Linear(x.shape[1], len(classes))
                    torch.nn.init.zeros_(head.weight)
                    torch.nn.init.zeros_(head.bias)
                    opt = torch.optim.Adam(head.parameters(), lr=1e-2, weight_decay=1e-2)
                loss = torch.nn.functional.cross_entropy(head((x - mean) / std), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            print(f"epoch {epoch}: {time.monotonic() - started:.2f} s, {len(losses)} batches, "
                  f"mean loss {sum(losses) / len(losses):.4f}")

    test = csd.torch_dataset([args.node], "textures_test", "efficientnet-lite0", weights=weights,
                             split=args.split)
    right = total = 0
    with torch.no_grad():
        for x, y in DataLoader(test, batch_size=None):
            right += int((head((x - mean) / std).argmax(1) == y).sum())
            total += len(y)
    print(f"held-out accuracy {right / total:.3f} on {total} patches ({right}/{total} right)")


if __name__ == "__main__":
    main()
