"""csd for Python: SQL pushed down to storage nodes, and a DNN's first layers run
next to the data with the features streamed into a training loop, as Arrow.

    import csd
    nodes = ["grpc://10.0.0.5:50051", "grpc://10.0.0.6:50051"]
    csd.put(nodes[0], "trips", pandas_frame)                 # or a pyarrow Table, a file
    table = csd.sql(nodes, "SELECT city, count(*) FROM trips GROUP BY city")
    df = table.to_pandas()

    csd.put_images(nodes, "imgs", "photos/", partitions=4)  # one folder per class
    for x, y in csd.features(nodes, "imgs", "efficientnet-lite0",
                             weights="efficientnet-lite0.safetensors", batch_size=32):
        ...                                                 # x: float32 [n, d], y: int64 [n]

Every call talks to `csd serve` nodes over gRPC (`grpc://` or `grpc+tls://`; a
bearer token and TLS files go in `auth={"token": ..., "tls_ca": PATH, "tls_cert":
PATH, "tls_key": PATH}`). Failures raise `CsdError` with the gRPC status in `.code`
and the node's message in `.message`. Ctrl-C stops the nodes' work.
"""

from __future__ import annotations

import json
import os
import random
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa

from . import _native
from ._native import CsdError, FeatureStream

__version__ = _native.__version__

__all__ = [
    "CsdError",
    "Epochs",
    "FeatureStream",
    "Features",
    "Plan",
    "epochs",
    "explain",
    "features",
    "put",
    "put_images",
    "sql",
    "sql_reader",
    "torch_dataset",
]

Nodes = Union[str, Sequence[str]]


def _error(code: str, message: str) -> CsdError:
    e = CsdError(f"{code}: {message}")
    e.code, e.message = code, message
    return e


def _nodes(nodes: Nodes) -> list:
    if isinstance(nodes, (str, os.PathLike)):
        return [str(nodes)]
    nodes = [str(n) for n in nodes]
    if not nodes:
        raise _error("InvalidArgument", "no storage nodes given")
    return nodes


def _settings(settings) -> Optional[list]:
    if settings is None:
        return None
    return [(str(k), str(v).lower() if isinstance(v, bool) else str(v)) for k, v in dict(settings).items()]


def sql_reader(nodes: Nodes, query: str, *, pushdown: bool = True, settings=None, auth=None) -> pa.RecordBatchReader:
    """Runs `query` over the nodes' tables and returns its answer as a
    `pyarrow.RecordBatchReader` that reads it batch by batch as it is computed (an
    answer larger than memory streams through). `pushdown=False` reads the tables'
    Parquet by byte range and computes everything here (`csd sql --no-pushdown`);
    `settings` are session settings applied first (e.g.
    `{"csd.direct_unfiltered": False}`). Ctrl-C while a batch is awaited stops the
    query and raises `KeyboardInterrupt`; a query that fails midway raises
    `CsdError`; closing the reader early stops the query too."""
    stream = _native.sql_stream(_nodes(nodes), query, pushdown=pushdown, settings=_settings(settings), auth=auth)
    return pa.RecordBatchReader.from_batches(stream.schema, stream)


def sql(nodes: Nodes, query: str, *, pushdown: bool = True, settings=None, auth=None) -> pa.Table:
    """Runs `query` (see `sql_reader`) and returns its whole answer as a
    `pyarrow.Table` (`.to_pandas()`, `polars.from_arrow(...)` from there). Ctrl-C
    raises `KeyboardInterrupt` and stops the query."""
    reader, _plan, _bytes = _native.sql(_nodes(nodes), query, pushdown=pushdown, settings=_settings(settings), auth=auth)
    return reader.read_all()


def explain(nodes: Nodes, query: str, *, pushdown: bool = True, settings=None, auth=None) -> str:
    """Runs `query` and returns the plan that ran with its metrics (what `EXPLAIN
    ANALYZE` shows: what each node did, rows and bytes), and the bytes that crossed
    the network."""
    _reader, plan, moved = _native.sql(_nodes(nodes), query, pushdown=pushdown, settings=_settings(settings), auth=auth)
    return f"{plan}bytes from the nodes: {moved}\n"


def _to_reader(data) -> pa.RecordBatchReader:
    if isinstance(data, pa.RecordBatchReader):
        return data
    if isinstance(data, pa.Table):
        return data.to_reader()
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data]).to_reader()
    if isinstance(data, (str, os.PathLike)):
        path = os.fspath(data)
        if not os.path.exists(path):
            raise _error("InvalidArgument", f"{path} does not exist")
        lower = path.lower()
        if lower.endswith(".parquet"):
            import pyarrow.parquet as pq

            f = pq.ParquetFile(path)
            return pa.RecordBatchReader.from_batches(f.schema_arrow, f.iter_batches())
        if lower.endswith(".csv"):
            import pyarrow.csv as pcsv

            return pcsv.open_csv(path)
        if lower.endswith((".arrow", ".feather", ".ipc")):
            import pyarrow.ipc as ipc

            return ipc.open_file(path).read_all().to_reader()
        raise _error("InvalidArgument", f"{path}: csd reads .parquet, .csv and .arrow files")
    if hasattr(data, "__arrow_c_stream__"):  # polars, and anything speaking the Arrow PyCapsule interface
        return pa.RecordBatchReader.from_stream(data)
    module = type(data).__module__
    if module.startswith("pandas"):
        return pa.Table.from_pandas(data, preserve_index=False).to_reader()
    raise _error(
        "InvalidArgument",
        f"cannot store a {type(data).__name__}: give a pyarrow Table, RecordBatch or "
        "RecordBatchReader, a pandas or polars DataFrame, or a .parquet/.csv/.arrow file",
    )


def put(node: str, table: str, data, *, partition: str = "0", auth=None) -> int:
    """Stores `data` (a pyarrow Table/RecordBatch/RecordBatchReader, a pandas or
    polars DataFrame, or a .parquet/.csv/.arrow file) as partition `partition` of
    `table` on `node`; returns the rows stored."""
    return _native.put(str(node), table, _to_reader(data), partition=str(partition), auth=auth)


def put_images(nodes: Nodes, table: str, folder, *, labels=None, partitions: int = 4, copies: int = 1, auth=None) -> Tuple[int, list]:
    """Stores the images under `folder` (a subfolder per class, or `labels`: a CSV
    of `file,label`) as dataset `table`, spread over the nodes in `partitions`
    partitions, each kept `copies` times. Returns (samples stored, class names)."""
    return _native.put_images(
        _nodes(nodes), table, os.fspath(folder), labels=None if labels is None else os.fspath(labels),
        partitions=partitions, copies=copies, auth=auth,
    )


class Plan:
    """The split planner's choice as data. `candidates` is a list of dicts, one per
    split and share of the partitions run whole here: `split` (stages at the
    nodes), `at_node` (the last of them), `here` (partitions run here),
    `here_samples`, `node_flops` and `compute_flops` (per sample),
    `bytes_per_sample`, and the predicted `node_s`, `link_s`, `compute_s` and
    `epoch_s`. `best` indexes the chosen one, `chosen` is it. `str(plan)` is the
    table `csd features --explain` prints."""

    def __init__(self, data: dict, text: str):
        self.candidates: List[dict] = data["candidates"]
        self.best: int = data["best"]
        self._text = text

    @property
    def chosen(self) -> dict:
        return self.candidates[self.best]

    def __str__(self) -> str:
        return self._text

    def __repr__(self) -> str:
        c = self.chosen
        return f"Plan(split={c['split']}, epoch_s={c['epoch_s']:.3f}, {len(self.candidates)} candidates)"


class Features:
    """One pass over a dataset's features (see `features`). Iterating gives
    `(x, y)`: `x` a float32 NumPy array `[n, d]`, `y` an int64 array `[n]`, views of
    the Arrow buffers (no copy unless shuffled). `arrow()` iterates the record
    batches (`id`, `label`, `features`) themselves."""

    def __init__(self, stream: FeatureStream, shuffle_buffer: int, seed: Optional[int], progress: bool):
        self._stream = stream
        self._shuffle = shuffle_buffer
        self._rng = random.Random(seed)
        self._progress = progress
        self._used = False

    @property
    def split(self) -> int:
        """Stages (an ONNX model's cut points) run at the nodes."""
        return self._stream.split

    @property
    def plan(self) -> Optional["Plan"]:
        """The planner's candidate splits, when it planned (`split="auto"` or
        `explain=True`)."""
        if self._stream.plan_json is None:
            return None
        return Plan(json.loads(self._stream.plan_json), self._stream.plan or "")

    @property
    def here(self) -> list:
        """Partitions read raw and run whole here."""
        return self._stream.here

    @property
    def bytes_received(self) -> int:
        return self._stream.bytes_received

    @property
    def pushed_back(self) -> int:
        """Partitions the nodes handed back, computed here."""
        return self._stream.pushed_back

    def close(self) -> None:
        """Stops the nodes' work."""
        self._stream.close()

    def arrow(self) -> Iterator[pa.RecordBatch]:
        if self._used:
            raise _error("FailedPrecondition", "a feature stream is read once; call csd.features again for another epoch")
        self._used = True
        bar = _bar(self._progress)
        try:
            for b in self._stream:
                if bar is not None:
                    bar.update(b.num_rows)
                yield b
        finally:
            if bar is not None:
                bar.close()
            self._stream.close()

    def __iter__(self) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
        batches = self.arrow()
        if self._shuffle <= 0:
            for b in batches:
                yield _arrays(b)
            return
        # A shuffle buffer of whole batches' samples, drawn in the batches' size.
        pool_x, pool_y, size = [], [], None
        for b in batches:
            x, y = _arrays(b)
            size = size or len(y)
            pool_x.append(x)
            pool_y.append(y)
            if sum(len(p) for p in pool_y) >= self._shuffle:
                x, y = np.concatenate(pool_x), np.concatenate(pool_y)
                order = np.random.default_rng(self._rng.getrandbits(32)).permutation(len(y))
                x, y = x[order], y[order]
                keep = len(y) - size
                yield x[keep:], y[keep:]
                pool_x, pool_y = [x[:keep]], [y[:keep]]
        if pool_y and sum(len(p) for p in pool_y):
            x, y = np.concatenate(pool_x), np.concatenate(pool_y)
            order = np.random.default_rng(self._rng.getrandbits(32)).permutation(len(y))
            x, y = x[order], y[order]
            for i in range(0, len(y), size or len(y)):
                yield x[i : i + (size or len(y))], y[i : i + (size or len(y))]


def _arrays(b: pa.RecordBatch) -> Tuple[np.ndarray, np.ndarray]:
    f = b.column("features")
    d = f.type.list_size
    x = f.flatten().to_numpy(zero_copy_only=True).reshape(len(b), d)
    y = b.column("label").to_numpy(zero_copy_only=True)
    return x, y


def _bar(progress: bool):
    if not progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(unit="samples")


def _job(nodes, dataset, model, split, batch_size, weights, tokenizer, mean, std, here, compression,
         skip_bad_samples, explain, keep_seconds, auth):
    return _native.feature_job(
        _nodes(nodes), dataset, os.fspath(model), split=str(split), batch_size=batch_size,
        weights=None if weights is None else os.fspath(weights),
        tokenizer=None if tokenizer is None else os.fspath(tokenizer),
        mean=None if mean is None else [float(v) for v in mean],
        std=None if std is None else [float(v) for v in std],
        here=here, compression=compression, skip_bad_samples=skip_bad_samples, explain=explain,
        keep_seconds=keep_seconds, auth=auth,
    )


def features(
    nodes: Nodes,
    dataset: str,
    model: str = "efficientnet-lite0",
    *,
    split: Union[str, int] = "auto",
    batch_size: int = 64,
    weights=None,
    tokenizer=None,
    mean: Optional[Sequence[float]] = None,
    std: Optional[Sequence[float]] = None,
    here: Optional[int] = None,
    compression: str = "auto",
    skip_bad_samples: bool = False,
    explain: bool = False,
    shuffle_buffer: int = 0,
    seed: Optional[int] = None,
    progress: bool = False,
    auth=None,
) -> Features:
    """One pass over the features of `dataset` through `model` — a built-in
    architecture (`efficientnet-lite0`, `resnet18`, `resnet50`, `minilm-l6`) with its
    `weights` file, or an ONNX image model's file (pixels normalised by
    `mean`/`std`) — with the first layers run at the nodes: `split` is `"auto"` (the
    planner's choice, `.plan` says why), a stage number, `"none"`, `"full"` or an
    ONNX tensor name. Training batches of `batch_size`, shuffled through a buffer of
    `shuffle_buffer` samples when it is given; a progress bar with `progress=True`
    where tqdm is installed. For several epochs, `epochs` plans once and can keep
    the nodes' output between them."""
    job = _job(nodes, dataset, model, split, batch_size, weights, tokenizer, mean, std, here, compression,
               skip_bad_samples, explain, None, auth)
    return Features(job.stream(), shuffle_buffer, seed, progress)


class Epochs:
    """Several passes over one dataset's features (see `epochs`): `epoch()` opens
    the next. The first plans the split (with `split="auto"`) and later ones keep
    it; with `keep=True` the nodes keep their output of the first, and later epochs
    read it back instead of running the nodes' layers again. `release()` (or leaving
    a `with` block) frees what the nodes keep."""

    def __init__(self, job, shuffle_buffer: int, seed: Optional[int], progress: bool):
        self._job = job
        self._shuffle = shuffle_buffer
        self._seed = seed
        self._progress = progress
        self._n = 0

    def epoch(self) -> Features:
        self._n += 1
        seed = None if self._seed is None else self._seed + self._n
        return Features(self._job.stream(), self._shuffle, seed, self._progress)

    @property
    def kept(self) -> list:
        """References (JSON) to what the nodes keep; `csd get` reads them."""
        return self._job.kept

    def release(self) -> None:
        self._job.release()

    def __enter__(self) -> "Epochs":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def epochs(
    nodes: Nodes,
    dataset: str,
    model: str = "efficientnet-lite0",
    *,
    keep: bool = False,
    ttl: float = 3600.0,
    split: Union[str, int] = "auto",
    batch_size: int = 64,
    weights=None,
    tokenizer=None,
    mean: Optional[Sequence[float]] = None,
    std: Optional[Sequence[float]] = None,
    here: Optional[int] = None,
    compression: str = "auto",
    skip_bad_samples: bool = False,
    explain: bool = False,
    shuffle_buffer: int = 0,
    seed: Optional[int] = None,
    progress: bool = False,
    auth=None,
) -> Epochs:
    """`features` for several epochs: the arguments are `features`'s, and `keep`
    keeps the nodes' output for `ttl` seconds so that epochs after the first do not
    run the nodes' layers again.

        with csd.epochs(nodes, "imgs", "efficientnet-lite0", weights=w, keep=True) as run:
            for _ in range(10):
                for x, y in run.epoch():
                    ...
    """
    job = _job(nodes, dataset, model, split, batch_size, weights, tokenizer, mean, std, here, compression,
               skip_bad_samples, explain, ttl if keep else None, auth)
    return Epochs(job, shuffle_buffer, seed, progress)


def torch_dataset(nodes: Nodes, dataset: str, model: str = "efficientnet-lite0", **kwargs):
    """A `torch.utils.data.IterableDataset` of `(x, y)` training batches as tensors
    (`x` float32 `[n, d]`, `y` int64 `[n]`, sharing the Arrow buffers): each
    iteration is an epoch of `epochs(nodes, dataset, model, **kwargs)`. Pass
    `keep=True` to keep the nodes' output between epochs, and call `release()` (or
    use it as a `with` block) when done. Use it with `DataLoader(ds, batch_size=None)`:
    its items are batches already. Needs torch; the rest of the package does not."""
    try:
        import torch
        from torch.utils.data import IterableDataset
    except ImportError as e:
        raise ImportError("csd.torch_dataset needs torch (pip install torch)") from e

    run = epochs(nodes, dataset, model, **kwargs)

    class _Dataset(IterableDataset):
        epochs = run

        def __iter__(self):
            import warnings

            for x, y in run.epoch():
                with warnings.catch_warnings():
                    # Unshuffled batches are views of the Arrow buffers NumPy calls
                    # read-only; they are this batch's alone, so sharing them is safe.
                    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                    yield torch.from_numpy(x), torch.from_numpy(y)

        def release(self) -> None:
            run.release()

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            run.release()

    return _Dataset()
