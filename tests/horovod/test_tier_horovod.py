"""The Horovod tier: hvd_slim inside a real, installed Horovod (``make install-horovod``).

tests/horovod/check_horovod.py runs under ``horovodrun -np 2`` and under ``mpirun -np 3``: Horovod's
own init, broadcasts and DistributedOptimizer baseline, hvd_slim's optimizer without
``hvd_slim.init()``; replicas identical after N steps; ``density=1.0`` equal to Horovod's dense
average to 1e-5; ``hvd.broadcast_optimizer_state`` on hvd_slim's optimizer; Compression.fp16.
tests/horovod/check_gloo_refused.py checks the clear refusal under ``horovodrun --gloo``.
Every launch runs in its own session under a hard timeout and is killed whole on expiry.

Without Horovod the tier is skipped, unless ``HVD_SLIM_REQUIRE_HOROVOD=1`` (CI), which turns
the skip into a failure. ``HVD_SLIM_HOROVOD_TIMEOUT`` (seconds, default 300) bounds each launch.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from tests.mpi_launch import run_mpi, run_session, session_env, tail

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "horovod"
TIMEOUT = float(os.environ.get("HVD_SLIM_HOROVOD_TIMEOUT", "300"))
REQUIRE = os.environ.get("HVD_SLIM_REQUIRE_HOROVOD", "") == "1"
CHECKS = ["check_starts_from_horovod", "check_density_one_matches_horovod",
          "check_replicas_identical", "check_broadcast_optimizer_state", "check_fp16_compression",
          "check_overlap_forward"]


@functools.lru_cache(maxsize=None)
def _horovod_problem() -> Optional[str]:
    """None when ``import horovod.torch`` works (in a child: its extension is heavy), else why not."""
    try:
        proc = subprocess.run([sys.executable, "-c", "import horovod.torch"], capture_output=True,
                              text=True, timeout=120, env=session_env())
    except subprocess.TimeoutExpired:
        return "`import horovod.torch` did not finish within 120s"
    if proc.returncode != 0:
        return f"`import horovod.torch` fails: {tail(proc.stderr, 1).strip()}"
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH"
    return None


@pytest.fixture
def horovod() -> None:
    problem = _horovod_problem()
    if problem is None:
        return
    message = f"Horovod tier: {problem}; build it with `make install-horovod`"
    if REQUIRE:
        pytest.fail(f"{message} (HVD_SLIM_REQUIRE_HOROVOD=1 forbids skipping)")
    pytest.skip(message)


def _horovodrun() -> str:
    here = Path(sys.executable).parent / "horovodrun"  # the venv's, even when not on PATH
    return str(here) if here.exists() else (shutil.which("horovodrun") or "horovodrun")


def _report_env(reports: Path) -> Dict[str, str]:
    """Where the ranks write their results; the default transport pinned to "auto" so that an
    HVD_SLIM_TRANSPORT in the caller's environment cannot change what the checks expect."""
    return {"HVD_SLIM_REPORT_DIR": str(reports), "HVD_SLIM_TRANSPORT": "auto"}


def _assert_all_ranks_passed(rc: int, out: str, reports: Path, np_: int, checks: List[str],
                             how: str) -> None:
    """Every rank's report file (stdout interleaves mid-line) lists every check as passed."""
    passed = set()
    for r in range(np_):
        path = reports / f"rank{r}.txt"
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        passed |= {(r, name) for name in
                   re.findall(rf"^hvd_slim-horovod: rank {r} of {np_} PASS (\w+)", text, re.M)}
    missing = [(r, c) for r in range(np_) for c in checks if (r, c) not in passed]
    assert rc == 0 and not missing, (f"{how}: exit {rc}, checks not passed (rank, check): "
                                     f"{missing}; output tail:\n{tail(out)}")


def test_under_horovodrun_np2(horovod: None, tmp_path: Path) -> None:
    argv = [_horovodrun(), "--mpi", "-np", "2", "-H", "localhost:2", sys.executable,
            str(SCRIPTS / "check_horovod.py")]
    rc, out, _ = run_session(argv, TIMEOUT, {**session_env(), **_report_env(tmp_path)})
    _assert_all_ranks_passed(rc, out, tmp_path, 2, CHECKS, "horovodrun --mpi -np 2")


def test_under_mpirun_np3(horovod: None, tmp_path: Path) -> None:
    rc, out, _ = run_mpi(3, [sys.executable, str(SCRIPTS / "check_horovod.py")], TIMEOUT,
                         extra_env=_report_env(tmp_path))
    _assert_all_ranks_passed(rc, out, tmp_path, 3, CHECKS, "mpirun -np 3")


def test_horovod_on_gloo_is_refused_clearly(horovod: None, tmp_path: Path) -> None:
    argv = [_horovodrun(), "--gloo", "-np", "2", "-H", "localhost:2", sys.executable,
            str(SCRIPTS / "check_gloo_refused.py")]
    rc, out, _ = run_session(argv, TIMEOUT, {**session_env(), **_report_env(tmp_path)})
    _assert_all_ranks_passed(rc, out, tmp_path, 2, ["check_gloo_refused"],
                             "horovodrun --gloo -np 2")
