#!/usr/bin/env python3
"""Converts a legacy (pre-1.6, non-zip) PyTorch checkpoint to safetensors, without torch.

The legacy format is a run of pickles: magic number, protocol version, system info,
the state dict (tensors refer to storages through persistent ids), the list of storage
keys, then each storage's raw bytes (little-endian, prefixed by an 8-byte element
count) in that order. We unpickle with stand-in classes for torch's, read the raw
storages, and write safetensors (8-byte header length, JSON header, data).

Usage: torch_legacy_to_safetensors.py IN.pth OUT.safetensors
"""
import collections
import itertools
import json
import pickle
import struct
import sys

MAGIC = 0x1950A86A20F9469CFC6C

# torch storage class name -> (safetensors dtype, element size)
STORAGES = {
    "FloatStorage": ("F32", 4),
    "DoubleStorage": ("F64", 8),
    "HalfStorage": ("F16", 2),
    "BFloat16Storage": ("BF16", 2),
    "LongStorage": ("I64", 8),
    "IntStorage": ("I32", 4),
    "ShortStorage": ("I16", 2),
    "CharStorage": ("I8", 1),
    "ByteStorage": ("U8", 1),
    "BoolStorage": ("BOOL", 1),
}


class StorageType:
    def __init__(self, name):
        if name not in STORAGES:
            raise ValueError(f"unsupported storage type torch.{name}")
        self.dtype, self.size = STORAGES[name]


class Storage:
    def __init__(self, stype, numel):
        self.dtype, self.elem, self.numel = stype.dtype, stype.size, numel
        self.data = None


class TensorRef:
    def __init__(self, storage, offset, size, stride):
        self.storage, self.offset, self.size, self.stride = storage, offset, tuple(size), tuple(stride)


def rebuild_tensor(storage, storage_offset, size, stride, *_rest):
    return TensorRef(storage, storage_offset, size, stride)


class StateDict(collections.OrderedDict):
    pass


class Unpickler(pickle.Unpickler):
    def __init__(self, f, storages):
        super().__init__(f)
        self.storages = storages

    def find_class(self, module, name):
        if module == "collections" and name == "OrderedDict":
            return StateDict
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return rebuild_tensor
        if module == "torch" and name.endswith("Storage"):
            return StorageType(name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")

    def persistent_load(self, pid):
        kind, stype, key, _location, numel, view = pid
        if kind != "storage":
            raise pickle.UnpicklingError(f"unknown persistent id kind {kind!r}")
        if view is not None:
            raise pickle.UnpicklingError("storage views are not supported")
        if key not in self.storages:
            self.storages[key] = Storage(stype, numel)
        return self.storages[key]


def contiguous(size, stride):
    acc = 1
    for s, st in zip(reversed(size), reversed(stride)):
        if s != 1 and st != acc:
            return False
        acc *= s
    return True


def gather(st, t, numel):
    """Row-major bytes of a strided tensor (e.g. one saved channels-last)."""
    e = st.elem
    out = bytearray(numel * e)
    pos = 0
    for idx in itertools.product(*(range(s) for s in t.size)):
        src = (t.offset + sum(i * s for i, s in zip(idx, t.stride))) * e
        out[pos:pos + e] = st.data[src:src + e]
        pos += e
    return bytes(out)


def convert(src, dst):
    storages = {}
    with open(src, "rb") as f:
        if pickle.load(f) != MAGIC:
            raise SystemExit(f"{src}: not a legacy PyTorch checkpoint (bad magic number)")
        pickle.load(f)  # protocol version
        pickle.load(f)  # sys info
        state = Unpickler(f, storages).load()
        keys = pickle.load(f)
        for key in keys:
            st = storages[key]
            (n,) = struct.unpack("<q", f.read(8))
            if n != st.numel:
                raise SystemExit(f"storage {key}: {n} elements on disk, {st.numel} expected")
            st.data = f.read(n * st.elem)
            if len(st.data) != n * st.elem:
                raise SystemExit(f"storage {key}: file is truncated")
    if "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    header, blobs, offset = {}, [], 0
    for name, t in state.items():
        if not isinstance(t, TensorRef):
            continue
        numel = 1
        for s in t.size:
            numel *= s
        st = t.storage
        if contiguous(t.size, t.stride):
            raw = st.data[t.offset * st.elem:(t.offset + numel) * st.elem]
        else:
            raw = gather(st, t, numel)
        header[name] = {"dtype": st.dtype, "shape": list(t.size), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(dst, "wb") as out:
        out.write(struct.pack("<Q", len(head)))
        out.write(head)
        for b in blobs:
            out.write(b)
    print(f"{dst}: {len(header)} tensors, {offset} bytes")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    convert(sys.argv[1], sys.argv[2])
