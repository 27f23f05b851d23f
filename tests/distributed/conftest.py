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
import types
from pathlib import Path
from typing import Any, Dict

import pytest

from hvd_slim.runtime import env_rank_size

_ENV = env_rank_size()
UNDER_MPI = _ENV is not None
_HERE = Path(__file__).resolve().parent
LAUNCHER = "test_tier_mpi.py"   # the tier's launcher: collected outside MPI only
_REASON = ("tests/distributed needs one process per MPI rank: run tests/distributed/test_tier_mpi.py, or "
           "`mpirun -np 2 python -m pytest tests/distributed -p no:cacheprovider`")
_counts: Dict[str, int] = {"passed": 0, "failed": 0, "skipped": 0}


class _SkippedModule(pytest.Module):
    """Stands in for a test module outside MPI: reports it skipped without importing it."""

    def collect(self) -> Any:
        pytest.skip(_REASON)


def pytest_pycollect_makemodule(module_path: Path, parent: Any) -> Any:
    if not UNDER_MPI and _HERE in Path(module_path).resolve().parents \
            and Path(module_path).name != LAUNCHER:
        return _SkippedModule.from_parent(parent, path=Path(module_path))
    return None


def pytest_ignore_collect(collection_path: Path, config: Any) -> Any:
    # Under MPI the launcher would start the tier again from inside it.
    return True if UNDER_MPI and collection_path.name == LAUNCHER else None


def _rank_tag() -> str:
    return f"rank {_ENV[0]}" if _ENV else "rank ?"


def _abort(nodeid: str, text: str) -> None:
    """Report a failure on this rank and end every rank of the job."""
    sys.stderr.write(f"\n{_rank_tag()}: FAILED {nodeid}\n{text}\n{_rank_tag()}: aborting the MPI job\n")
    sys.stdout.flush()
    sys.stderr.flush()
    from hvd_slim.transport import mpi_comm
    mpi_comm.abort_world(1)


def pytest_sessionstart(session: Any) -> None:
    if UNDER_MPI:
        import hvd_slim
        hvd_slim.init()


def pytest_collectreport(report: Any) -> None:
    if UNDER_MPI and report.failed:
        _abort(report.nodeid or "<collection>", str(report.longrepr))


def pytest_runtest_logreport(report: Any) -> None:
    if not UNDER_MPI:
        return
    if report.failed:
        _counts["failed"] += 1
        _abort(report.nodeid, report.longreprtext)
    elif report.when == "call" and report.passed:
        _counts["passed"] += 1
    elif report.skipped:
        _counts["skipped"] += 1


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    if UNDER_MPI:
        rank, size, _ = _ENV
        sys.stdout.write(f"\nhvd_slim-tier: rank {rank} of {size} passed={_counts['passed']} "
                         f"failed={_counts['failed']} skipped={_counts['skipped']} exitstatus={int(exitstatus)}\n")
        sys.stdout.flush()


@pytest.fixture(scope="session")
def hvd() -> Any:
    """The public API as a Horovod script sees it (``import hvd_slim as hvd``), assembled from the
    modules so the tests do not depend on what ``hvd_slim/__init__.py`` re-exports yet."""
    import hvd_slim
    from hvd_slim.api import collectives, functions
    from hvd_slim import runtime
    ns = types.SimpleNamespace()
    for module in (runtime, collectives, functions, hvd_slim):
        for key in dir(module):
            if not key.startswith("_"):
                setattr(ns, key, getattr(module, key))
    return ns


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
