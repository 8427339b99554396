"""What the Python package's tests share: the nodes and the `csd` binary the Rust
driver (tests/python.rs) started and built, and a way to compare answers."""

import datetime
import decimal
import json
import os
import subprocess

import pytest


@pytest.fixture(scope="session")
def nodes():
    return os.environ["CSD_NODES"].split(",")


@pytest.fixture(scope="session")
def csd_bin():
    return os.environ["CSD_BIN"]


@pytest.fixture(scope="session")
def work():
    return os.environ["CSD_WORK"]


def cli(csd_bin, *args):
    """Runs `csd ARGS` and returns its stdout; fails the test with its stderr."""
    out = subprocess.run([csd_bin, *args], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def node_args(nodes):
    return [a for n in nodes for a in ("--node", n)]


def value(v):
    """A cell as a comparable value: numbers to 9 significant digits (sums differ in
    their last bits between plans), dates and times as ISO text."""
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, (int, float, decimal.Decimal)):
        return float(f"{float(v):.9g}")
    if isinstance(v, (datetime.date, datetime.datetime)):
        return v.isoformat()
    if isinstance(v, str):
        try:
            return float(f"{float(v):.9g}")
        except ValueError:
            return v
    return str(v)


def rows_of_table(t):
    return sorted(tuple(value(v) for v in row.values()) for row in t.to_pylist())


def rows_of_cli_json(text, columns):
    """`csd sql --format json` output (a JSON array, or one object per line)."""
    text = text.strip()
    if not text:
        return []
    if text.startswith("["):
        records = json.loads(text)
    else:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    return sorted(tuple(value(r.get(c)) for c in columns) for r in records)
