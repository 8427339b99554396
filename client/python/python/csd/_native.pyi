"""Type hints of the native module (`csd._native`); use the `csd` package."""

from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import pyarrow as pa

__version__: str

class CsdError(Exception):
    """A csd call failed."""

    code: str
    """The gRPC status, e.g. "Unavailable", "NotFound", "InvalidArgument"."""
    message: str
    """What happened and what to do."""

class FeatureStream(Iterator[pa.RecordBatch]):
    split: int
    here: List[int]
    plan: Optional[str]
    plan_json: Optional[str]
    bytes_received: int
    pushed_back: int
    skipped: int
    def __iter__(self) -> "FeatureStream": ...
    def __next__(self) -> pa.RecordBatch: ...
    def close(self) -> None: ...

def sql(
    nodes: Sequence[str],
    query: str,
    *,
    pushdown: bool = True,
    settings: Optional[Sequence[Tuple[str, str]]] = None,
    auth: Optional[Dict[str, str]] = None,
) -> Tuple[pa.RecordBatchReader, str, int]: ...
class AnswerStream(Iterator[pa.RecordBatch]):
    schema: pa.Schema
    def __iter__(self) -> "AnswerStream": ...
    def __next__(self) -> pa.RecordBatch: ...
    def close(self) -> None: ...

def sql_stream(
    nodes: Sequence[str],
    query: str,
    *,
    pushdown: bool = True,
    settings: Optional[Sequence[Tuple[str, str]]] = None,
    auth: Optional[Dict[str, str]] = None,
) -> AnswerStream: ...
def put(
    node: str,
    table: str,
    data: pa.RecordBatchReader,
    *,
    partition: str = "0",
    auth: Optional[Dict[str, str]] = None,
) -> int: ...
def put_images(
    nodes: Sequence[str],
    table: str,
    folder: str,
    *,
    labels: Optional[str] = None,
    partitions: int = 4,
    copies: int = 1,
    auth: Optional[Dict[str, str]] = None,
) -> Tuple[int, List[str]]: ...
class FeatureJob:
    kept: List[str]
    def stream(self) -> FeatureStream: ...
    def release(self) -> None: ...

def feature_job(
    nodes: Sequence[str],
    dataset: str,
    model: str,
    *,
    split: str = "auto",
    batch_size: int = 64,
    weights: Optional[str] = None,
    tokenizer: Optional[str] = None,
    mean: Optional[Sequence[float]] = None,
    std: Optional[Sequence[float]] = None,
    here: Optional[int] = None,
    compression: str = "auto",
    skip_bad_samples: bool = False,
    explain: bool = False,
    keep_seconds: Optional[float] = None,
    auth: Optional[Dict[str, str]] = None,
) -> FeatureJob: ...
