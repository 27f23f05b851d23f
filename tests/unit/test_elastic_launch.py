"""Elastic training under mpirun -np 3 with one rank failing mid-run (tests/scripts/elastic_train.py).

* A rank raises HorovodInternalError and stays alive: the others time out in the exchange, all
  three restore the last commit (the exchange's residuals and server state too) and retry; the
  result is bitwise the uninterrupted run's.
* A rank is SIGKILLed (``mpirun --enable-recovery``): the two survivors time out, agree, rebuild
  hvd_slim without it, restore the last commit and finish; their parameters are bitwise equal to
  each other's and to a 2-rank job restarted from that commit.

Each launch has a hard timeout (tests/mpi_launch.py kills the session), so a hang fails the test.
"""
import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.mpi_launch import run_mpi

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "elastic_train.py"
TIMEOUT = "2"   # HVD_SLIM_TIMEOUT: how long the survivors wait for the failed rank

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(shutil.which("mpirun") is None
                       or importlib.util.find_spec("mpi4py") is None,
                       reason="needs mpirun and mpi4py"),
]


def launch(np_, mode, directory, *args, timeout_env=TIMEOUT, recovery=False):
    directory.mkdir(parents=True, exist_ok=True)   # where rank 0 writes its commits
    args = (mode, directory, *args)
    command = [sys.executable, str(SCRIPT), *map(str, args)]
    if recovery:   # mpirun's own option, before the MCA arguments run_mpi adds
        command = ["--enable-recovery", *command]
    rc, out, took = run_mpi(np_, command, 240.0, extra_env={"HVD_SLIM_TIMEOUT": timeout_env},
                            drop=("HOROVOD_", "HVD_SLIM_"))
    return rc, out


def hashes(out):
    return dict(re.findall(r"elastic: rank (\d) of \d step \d+ hash ([0-9a-f]{16})", out))


def test_a_rank_raising_horovod_internal_error_is_retried_bitwise(tmp_path):
    rc, out = launch(3, "none", tmp_path / "a", timeout_env="60")
    assert rc == 0 and len(hashes(out)) == 3, out[-3000:]
    rc, failed = launch(3, "raise", tmp_path / "b", 1, 4)
    context = failed[-4000:]
    assert rc == 0, context
    assert "elastic: rank 1 fails with raise at step 4" in failed, context
    assert failed.count("elastic: restored to step 3 on 3 ranks") == 3, context
    assert hashes(failed) == hashes(out) and len(set(hashes(out).values())) == 1, context


def test_survivors_of_a_killed_rank_finish_from_the_last_commit(tmp_path):
    rc, out = launch(3, "kill", tmp_path, 1, 4, recovery=True)
    context = out[-4000:]
    assert "elastic: rank 1 fails with kill at step 4" in out, context
    assert "continuing on COMM_WORLD ranks [0, 2]" in out, context
    restored = re.findall(r"elastic: restored to step (\d+) on 2 ranks", out)
    assert len(restored) == 2 and len(set(restored)) == 1, context
    survivors = hashes(out)
    assert set(survivors) == {"0", "1"} and len(set(survivors.values())) == 1, context
    rc, ref = launch(2, "reference", tmp_path, -1, restored[0], timeout_env="60")
    assert rc == 0, ref[-3000:]
    assert hashes(ref) == survivors, ref[-3000:] + context
