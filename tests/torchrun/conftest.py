"""The torchrun tier: one pytest process per rank under ``torchrun``, every rank running the same
tests in the same order on ``hvd.init()`` over torch.distributed, with no MPI: ``mpi4py`` is
made unimportable on every rank before hvd_slim starts, so anything that still reached for MPI
would fail here.

Launched by ``test_tier_torchrun.py``, this tier's launcher, which runs as an ordinary test
outside torchrun (or by hand: ``HVD_SLIM_TORCHRUN_TIER=1 python -m torch.distributed.run
--standalone --nproc-per-node 2 -m pytest tests/torchrun -p no:cacheprovider``).

* Without ``HVD_SLIM_TORCHRUN_TIER=1`` and torchrun's variables the rank-side modules are not
  even imported: each is reported as skipped, so a plain ``pytest tests/`` never runs them in a
  single process.
* A failure or error on any rank prints ``rank R: FAILED <nodeid>`` with the report and ends
  the job (hvd_slim's own way: exit status 1, torchrun stops the others), since the other ranks
  would otherwise wait in the failed test's next collective until they time out.
* At the end every rank prints ``hvd_slim-torchrun-tier: rank R of N passed=P failed=F
  skipped=S exitstatus=E`` for the launcher to check.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.rank_tier import OutsideTheJob, RankHooks, api_namespace

TIER_ENV = "HVD_SLIM_TORCHRUN_TIER"
UNDER_TORCHRUN = os.environ.get(TIER_ENV) == "1" and "TORCHELASTIC_RUN_ID" in os.environ
_HERE = Path(__file__).resolve().parent
LAUNCHER = "test_tier_torchrun.py"
_REASON = ("tests/torchrun needs one process per rank under torchrun: run "
           "tests/torchrun/test_tier_torchrun.py (see its conftest for the command)")

if UNDER_TORCHRUN:
    # No MPI in this tier: an import of mpi4py anywhere raises ImportError.
    sys.modules["mpi4py"] = None  # type: ignore[assignment]


# Bound as this conftest's own hooks, not registered as a plugin: pytest then calls them only
# for the paths below this folder.
_outside = OutsideTheJob(UNDER_TORCHRUN, _HERE, LAUNCHER, _REASON)
pytest_pycollect_makemodule = _outside.pycollect_makemodule
pytest_ignore_collect = _outside.ignore_collect


def _end(report: str) -> None:
    """Print a failed test's ``report`` and end every rank of the job (hvd_slim's own way: exit
    status 1, and torchrun stops the others)."""
    from hvd_slim.runtime import abort
    sys.stdout.flush()
    abort.end_job(report)


def pytest_configure(config: pytest.Config) -> None:
    """Register this rank's hooks (see tests/rank_tier.py)."""
    config.pluginmanager.register(RankHooks(
        UNDER_TORCHRUN, rank=os.environ.get("RANK"), size=os.environ.get("WORLD_SIZE"),
        end_job=_end, ending="ending the torchrun job", prefix="hvd_slim-torchrun-tier"))


@pytest.fixture(scope="session")
def hvd() -> Any:
    """The public API as a Horovod script sees it (``import hvd_slim as hvd``), with the
    runtime's extra queries (``backend``, ``job_comm``, ``world_transport``)."""
    import hvd_slim
    from hvd_slim import runtime
    return api_namespace(runtime, hvd_slim)


@pytest.fixture
def sets(hvd: Any) -> Any:
    """The even and odd ranks' process sets, removed afterwards (checked)."""
    n = hvd.size()
    even = hvd.add_process_set(list(range(0, n, 2)))
    odd = hvd.add_process_set(list(range(1, n, 2)))
    yield even, odd
    assert hvd.remove_process_set(even) and even.process_set_id is None
    assert hvd.remove_process_set(odd) and odd.process_set_id is None
