"""Distributed tier: one pytest process per MPI rank, all running the same tests in the same order.

Launched by ``test_tier_mpi.py``, this tier's launcher, which runs as an ordinary test outside
MPI (or by hand:
``mpirun -np 2 python -m pytest tests/distributed -q -p no:cacheprovider``).

* Without MPI launcher variables the modules here are not even imported: each is reported as
  skipped, so a plain ``pytest tests/`` never runs them in a single process.
* A failure or error on any rank prints ``rank R: FAILED <nodeid>`` with the report and aborts the
  whole job: the other ranks would otherwise wait forever in the failed test's next collective.
* At the end every rank prints ``hvd_slim-tier: rank R of N passed=P failed=F skipped=S`` for the
  launcher to check.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from hvd_slim.runtime import env_rank_size
from tests.rank_tier import OutsideTheJob, RankHooks, api_namespace

_ENV = env_rank_size()
UNDER_MPI = _ENV is not None
_HERE = Path(__file__).resolve().parent
LAUNCHER = "test_tier_mpi.py"   # the tier's launcher: collected outside MPI only
_REASON = ("tests/distributed needs one process per MPI rank: run tests/distributed/test_tier_mpi.py, or "
           "`mpirun -np 2 python -m pytest tests/distributed -p no:cacheprovider`")


# Bound as this conftest's own hooks, not registered as a plugin: pytest then calls them only
# for the paths below this folder.
_outside = OutsideTheJob(UNDER_MPI, _HERE, LAUNCHER, _REASON)
pytest_pycollect_makemodule = _outside.pycollect_makemodule
pytest_ignore_collect = _outside.ignore_collect


def _abort(report: str) -> None:
    """Print a failed test's ``report`` and abort every rank of the MPI job."""
    sys.stderr.write(f"{report}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    from hvd_slim.transport import mpi_comm
    mpi_comm.abort_world(1)


def pytest_configure(config: pytest.Config) -> None:
    """Register this rank's hooks (see tests/rank_tier.py)."""
    config.pluginmanager.register(RankHooks(
        UNDER_MPI, rank=_ENV[0] if _ENV else None, size=_ENV[1] if _ENV else None,
        end_job=_abort, ending="aborting the MPI job", prefix="hvd_slim-tier"))


@pytest.fixture(scope="session")
def hvd() -> Any:
    """The public API as a Horovod script sees it (``import hvd_slim as hvd``), assembled from the
    modules so the tests do not depend on what ``hvd_slim/__init__.py`` re-exports yet."""
    import hvd_slim
    from hvd_slim.api import collectives, functions
    from hvd_slim import runtime
    return api_namespace(runtime, collectives, functions, hvd_slim)


@pytest.fixture
def sets(hvd: Any) -> Any:
    """The even and odd ranks' process sets (the odd one None in a 1-rank job), removed
    afterwards (checked: a removal returns True and invalidates the set)."""
    n = hvd.size()
    even = hvd.add_process_set(list(range(0, n, 2)))
    odd = hvd.add_process_set(list(range(1, n, 2))) if n > 1 else None
    yield even, odd
    assert hvd.remove_process_set(even) and even.process_set_id is None
    if odd is not None:
        assert hvd.remove_process_set(odd)


@pytest.fixture
def my_set(hvd: Any, sets: Any) -> Any:
    """This rank's set of :func:`sets`: the even ranks' or the odd ranks'."""
    return sets[hvd.rank() % 2]
