"""HAPI's baseline for `features_epochs.py`: plain PyTorch reading the raw images over
the link (HTTP, as from an object store), decoding them in DataLoader workers and
running all of EfficientNet-Lite0's feature extractor here. The model is written
from the architecture walk in ml-pushdown/tests/reference/effnet_lite0.py and loads
the same safetensors weights; preprocessing is the node's (shorter side to 256,
bilinear, center crop 224, ImageNet mean and std).
"""

import io
import os
import sys
import urllib.request

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "ml-pushdown", "tests", "reference"))
from effnet_lite0 import EPS, blocks, read_st  # noqa: E402

MEAN = np.array([0.485, 0.456, 0.406], np.float32).reshape(3, 1, 1)
STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(3, 1, 1)


class LiteFeatures(torch.nn.Module):
    """EfficientNet-Lite0 from the stem to the global pool: 1280 floats per image."""

    def __init__(self, weights_path):
        super().__init__()
        w = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in read_st(weights_path).items() if v.dtype != np.int64}
        self.w = w
        self.blocks = list(blocks())

    def bn(self, x, p):
        w = self.w
        return F.batch_norm(x, w[f"{p}.running_mean"], w[f"{p}.running_var"], w[f"{p}.weight"], w[f"{p}.bias"],
                            training=False, eps=EPS)

    def conv(self, x, name, stride=1, groups=1):
        k = self.w[name].shape[-1]
        return F.conv2d(x, self.w[name], stride=stride, padding=k // 2, groups=groups)

    def forward(self, x):
        x = F.relu6(self.bn(self.conv(x, "_conv_stem.weight", 2), "_bn0"))
        for p, stride, inp, cout, e in self.blocks:
            y = x
            if e != 1:
                y = F.relu6(self.bn(self.conv(y, p + "._expand_conv.weight"), p + "._bn0"))
            y = F.relu6(self.bn(self.conv(y, p + "._depthwise_conv.weight", stride, groups=y.shape[1]), p + "._bn1"))
            y = self.bn(self.conv(y, p + "._project_conv.weight"), p + "._bn2")
            x = y + x if stride == 1 and inp == cout else y
        x = F.relu6(self.bn(self.conv(x, "_conv_head.weight"), "_bn1"))
        return x.mean(dim=(2, 3))


def preprocess(raw: bytes) -> np.ndarray:
    img = Image.open(io.BytesIO(raw)).convert("RGB")
    w, h = img.size
    scale = 256 / min(w, h)
    nw, nh = max(round(w * scale), 224), max(round(h * scale), 224)
    img = img.resize((nw, nh), Image.BILINEAR)
    x0, y0 = (nw - 224) // 2, (nh - 224) // 2
    img = img.crop((x0, y0, x0 + 224, y0 + 224))
    a = np.asarray(img, np.float32).transpose(2, 0, 1) / 255.0
    return (a - MEAN) / STD


class RemoteImages(torch.utils.data.Dataset):
    """The images under `folder` (a subfolder per class), read from `url` (which
    serves that folder) one request per image."""

    def __init__(self, folder, url):
        classes = sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))
        self.items = [
            (f"{url}/{c}/{f}", label)
            for label, c in enumerate(classes)
            for f in sorted(os.listdir(os.path.join(folder, c)))
        ]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        url, label = self.items[i]
        with urllib.request.urlopen(url) as r:
            raw = r.read()
        return torch.from_numpy(preprocess(raw)), label


def epochs(folder, url, weights_path, batch, workers):
    """A function running one epoch: (x, y) NumPy batches of features."""
    model = LiteFeatures(weights_path).eval()
    data = RemoteImages(folder, url)

    def one():
        loader = torch.utils.data.DataLoader(data, batch_size=batch, num_workers=workers)
        with torch.inference_mode():
            for x, y in loader:
                yield model(x).numpy(), y.numpy()

    return one
