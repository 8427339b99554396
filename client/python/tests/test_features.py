"""`csd.features` against `csd features`: the same features for the same split,
in the batch size asked for, shuffled when asked; bad input and Ctrl-C."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

import csd
from conftest import cli, node_args

WEIGHTS = os.path.join(
    os.environ.get("CSD_ML_HOME", os.path.expanduser("~/.cache/csd/ml")), "efficientnet-lite0.safetensors"
)


@pytest.fixture(scope="module")
def dataset(nodes):
    n, classes = csd.put_images(nodes, "imgs", os.environ["CSD_IMAGES"], partitions=2)
    assert (n, classes) == (12, ["c0", "c1", "c2"])
    return "imgs"


@pytest.fixture(scope="module")
def weights():
    if not os.path.isfile(WEIGHTS):
        pytest.skip(f"no {WEIGHTS} (run scripts/setup-ml.sh)")
    return WEIGHTS


def by_id(batches):
    out = {}
    for b in batches:
        ids = b.column("id").to_pylist()
        x = b.column("features").flatten().to_numpy().reshape(len(ids), -1)
        for i, row in zip(ids, x):
            assert i not in out, f"sample {i} twice"
            out[i] = row
    return out


def test_features_equal_csd_features_for_the_same_split(nodes, csd_bin, work, dataset, weights):
    stream = csd.features(nodes, dataset, "efficientnet-lite0", weights=weights, split=3, batch_size=5)
    got = by_id(stream.arrow())
    assert stream.split == 3 and stream.pushed_back == 0 and stream.bytes_received > 0
    out = os.path.join(work, "f.parquet")
    cli(csd_bin, "features", "--dataset", dataset, "--model", "efficientnet-lite0", "--weights", weights,
        "--split", "3", "--out", out, *node_args(nodes))
    want = by_id(pq.read_table(out).to_batches())
    assert sorted(got) == sorted(want) == list(range(12))
    for i in want:
        np.testing.assert_allclose(got[i], want[i], rtol=1e-5, atol=1e-6, err_msg=f"sample {i}")


def test_training_batches_in_the_size_asked_shuffled_when_asked(nodes, dataset, weights):
    plain = list(csd.features(nodes, dataset, "efficientnet-lite0", weights=weights, split=2, batch_size=5))
    assert [len(y) for _, y in plain] == [5, 5, 2]
    assert all(x.dtype == np.float32 and x.shape[0] == len(y) and y.dtype == np.int64 for x, y in plain)
    x0 = np.concatenate([x for x, _ in plain])
    y0 = np.concatenate([y for _, y in plain])
    shuffled = list(csd.features(nodes, dataset, "efficientnet-lite0", weights=weights, split=2, batch_size=5,
                                 shuffle_buffer=8, seed=7))
    assert sum(len(y) for _, y in shuffled) == 12 and all(len(y) <= 5 for _, y in shuffled)
    x1 = np.concatenate([x for x, _ in shuffled])
    y1 = np.concatenate([y for _, y in shuffled])
    # The same samples, each with its own label, in another order.
    key = lambda x, y: sorted((tuple(np.round(r[:8], 4)), int(l)) for r, l in zip(x, y))
    assert key(x0, y0) == key(x1, y1)
    assert not np.array_equal(x0, x1)


def test_epochs_keep_the_nodes_output_and_give_the_same_features(nodes, dataset, weights):
    with csd.epochs(nodes, dataset, "efficientnet-lite0", weights=weights, split=3, batch_size=5,
                    keep=True, ttl=600) as run:
        first = run.epoch()
        one = by_id(first.arrow())
        assert len(run.kept) == 2, run.kept  # one reference per partition
        second = run.epoch()
        two = by_id(second.arrow())
        assert second.split == 3
        assert sorted(one) == sorted(two) == list(range(12))
        for i in one:
            np.testing.assert_array_equal(one[i], two[i])
    assert run.kept == []  # released on leaving the block


def test_the_planner_explains_its_split(nodes, dataset, weights):
    stream = csd.features(nodes, dataset, "efficientnet-lite0", weights=weights, split="auto", batch_size=4)
    plan = stream.plan
    assert plan is not None and "split" in str(plan).lower(), str(plan)
    # The plan as data: one candidate per split and share, the chosen one the split run.
    assert plan.chosen["split"] == stream.split, plan.candidates
    assert {c["split"] for c in plan.candidates} >= {0, stream.split}
    for c in plan.candidates:
        assert c["epoch_s"] > 0 and c["bytes_per_sample"] >= 0, c
    # The planner takes the fewest bytes among the candidates within 3% of the fastest.
    fastest = min(c["epoch_s"] for c in plan.candidates)
    near = [c for c in plan.candidates if c["epoch_s"] <= fastest * 1.03 + 1e-9]
    assert plan.chosen in near and plan.chosen["bytes_per_sample"] == min(c["bytes_per_sample"] for c in near)
    assert sum(len(y) for _, y in stream) == 12
    # A fixed split is not planned.
    assert csd.features(nodes, dataset, "efficientnet-lite0", weights=weights, split=2).plan is None


def test_bad_requests_say_what_to_do(nodes, dataset, weights):
    with pytest.raises(csd.CsdError) as e:
        csd.features(nodes, dataset, "resnet9", weights=weights)
    assert e.value.code == "InvalidArgument" and "resnet18" in e.value.message, e.value.message
    with pytest.raises(csd.CsdError) as e:
        csd.features(nodes, "no_such_dataset", "efficientnet-lite0", weights=weights, split=2)
    assert "no_such_dataset" in e.value.message, e.value.message
    with pytest.raises(csd.CsdError) as e:
        csd.features(nodes, dataset, "efficientnet-lite0")
    assert "--weights is required" in e.value.message
    with pytest.raises(csd.CsdError) as e:
        csd.features(nodes, dataset, "efficientnet-lite0", weights=weights, split="sideways")
    assert e.value.code == "InvalidArgument"


def test_ctrl_c_stops_a_wait_and_the_nodes_serve_on(nodes):
    # 900 million comparisons of a nested-loop join: far longer than the half second
    # after which Ctrl-C comes.
    heavy = "SELECT count(*) FROM lineitem a, orders b WHERE a.l_extendedprice > b.o_totalprice"
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    started = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            csd.sql(nodes, heavy)
    finally:
        timer.cancel()
    assert time.monotonic() - started < 5
    assert csd.sql(nodes, "SELECT count(*) AS n FROM region").column("n").to_pylist() == [5]


def test_a_torch_dataset_gives_the_features_of_the_stream(nodes, dataset, weights):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    whole = {}
    for b in csd.features(nodes, dataset, "efficientnet-lite0", weights=weights, split=3).arrow():
        for f, label in zip(b.column("features").to_numpy(zero_copy_only=False), b.column("label").to_pylist()):
            whole.setdefault(label, []).append(np.asarray(f))
    with csd.torch_dataset(nodes, dataset, "efficientnet-lite0", weights=weights, split=3, batch_size=5, keep=True) as ds:
        for _epoch in range(2):
            sizes, seen = [], {}
            for x, y in DataLoader(ds, batch_size=None):
                assert x.dtype == torch.float32 and y.dtype == torch.int64
                sizes.append(len(y))
                for row, label in zip(x.numpy(), y.tolist()):
                    seen.setdefault(label, []).append(row)
            assert sizes == [5, 5, 2]
            for label, rows in whole.items():
                got = sorted(seen[label], key=lambda r: r.tobytes())
                want = sorted(rows, key=lambda r: r.tobytes())
                np.testing.assert_allclose(np.stack(got), np.stack(want), rtol=1e-5, atol=1e-6)
        assert ds.epochs.kept  # the nodes kept the first epoch's output
    assert ds.epochs.kept == []


def test_the_training_example_matches_the_rust_one(nodes, weights):
    """docs/examples/train_head.py (NumPy) against client/examples/train_head.rs
    (candle) on the same node and texture patches: the same held-out accuracy, to
    a patch."""
    home = os.path.dirname(weights)
    if not os.path.isdir(os.path.join(home, "textures", "train")):
        pytest.skip(f"no texture patches in {home} (run scripts/setup-ml.sh)")
    rust = os.path.join(os.environ["CSD_EXAMPLES"], "train_head")
    if not os.path.isfile(rust):
        pytest.skip(f"{rust} is not built (cargo test --workspace builds it)")
    example = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "examples", "train_head.py")
    args = ["--node", nodes[0], "--epochs", "3"]
    py = subprocess.run([sys.executable, example, *args], capture_output=True, text=True,
                        env={**os.environ, "CSD_ML_HOME": home})
    assert py.returncode == 0, py.stderr
    rs = subprocess.run([rust, *args], capture_output=True, text=True, env={**os.environ, "CSD_ML_HOME": home})
    assert rs.returncode == 0, rs.stderr
    py_acc = float(re.search(r"held-out accuracy ([0-9.]+) on (\d+)", py.stdout).group(1))
    m = re.search(r"held-out accuracy: (\d+)/(\d+)", rs.stdout)
    rs_acc, n = int(m.group(1)) / int(m.group(2)), int(m.group(2))
    print(f"held-out accuracy: Python {py_acc:.3f}, Rust {rs_acc:.3f} on {n} patches")
    assert py_acc > 0.5 and abs(py_acc - rs_acc) <= 1 / n + 1e-9, (py.stdout, rs.stdout)
    # The same in PyTorch where it is installed, the node's output kept between epochs.
    try:
        import torch  # noqa: F401
    except ImportError:
        return
    example = example.replace("train_head.py", "train_head_torch.py")
    pt = subprocess.run([sys.executable, example, *args, "--keep"], capture_output=True, text=True,
                        env={**os.environ, "CSD_ML_HOME": home})
    assert pt.returncode == 0, pt.stderr
    pt_right = int(re.search(r"\((\d+)/(\d+) right\)", pt.stdout).group(1))
    print(f"held-out accuracy: PyTorch {pt_right}/{n}")
    # Within a patch: the order batches arrive in from the two partitions varies.
    assert abs(pt_right - round(rs_acc * n)) <= 1, (pt.stdout, rs.stdout)
