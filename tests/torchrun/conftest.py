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
import types
from pathlib import Path
from typing import Any, Dict

import pytest

TIER_ENV = "HVD_SLIM_TORCHRUN_TIER"
UNDER_TORCHRUN = os.environ.get(TIER_ENV) == "1" and "TORCHELASTIC_RUN_ID" in os.environ
_HERE = Path(__file__).resolve().parent
LAUNCHER = "test_tier_torchrun.py"
_REASON = ("tests/torchrun needs one process per rank under torchrun: run "
           "tests/torchrun/test_tier_torchrun.py (see its conftest for the command)")
_counts: Dict[str, int] = {"passed": 0, "failed": 0, "skipped": 0}

if UNDER_TORCHRUN:
    # No MPI in this tier: an import of mpi4py anywhere raises ImportError.
    sys.modules["mpi4py"] = None  # type: ignore[assignment]


class _SkippedModule(pytest.Module):
    """Stands in for a rank-side module outside torchrun: reported skipped, never imported."""

    def collect(self) -> Any:
        pytest.skip(_REASON)


def pytest_pycollect_makemodule(module_path: Path, parent: Any) -> Any:
    if not UNDER_TORCHRUN and Path(module_path).resolve().parent == _HERE \
            and Path(module_path).name != LAUNCHER:
        return _SkippedModule.from_parent(parent, path=Path(module_path))
    return None


def pytest_ignore_collect(collection_path: Path, config: Any) -> Any:
    # Under torchrun the launcher would start the tier again from inside it.
    return True if UNDER_TORCHRUN and collection_path.name == LAUNCHER else None


def _tag() -> str:
    return f"rank {os.environ.get('RANK', '?')}"


def _end(nodeid: str, text: str) -> None:
    """Report a failure on this rank and end every rank of the job."""
    from hvd_slim.runtime import abort
    sys.stdout.flush()
    abort.end_job(f"\n{_tag()}: FAILED {nodeid}\n{text}\n{_tag()}: ending the torchrun job")


def pytest_sessionstart(session: Any) -> None:
    if UNDER_TORCHRUN:
        import hvd_slim
        hvd_slim.init()


def pytest_collectreport(report: Any) -> None:
    if UNDER_TORCHRUN and report.failed:
        _end(report.nodeid or "<collection>", str(report.longrepr))


def pytest_runtest_logreport(report: Any) -> None:
    if not UNDER_TORCHRUN:
        return
    if report.failed:
        _counts["failed"] += 1
        _end(report.nodeid, report.longreprtext)
    elif report.when == "call" and report.passed:
        _counts["passed"] += 1
    elif report.skipped:
        _counts["skipped"] += 1


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    if UNDER_TORCHRUN:
        sys.stdout.write(f"\nhvd_slim-torchrun-tier: rank {os.environ['RANK']} of "
                         f"{os.environ['WORLD_SIZE']} passed={_counts['passed']} "
                         f"failed={_counts['failed']} skipped={_counts['skipped']} "
                         f"exitstatus={int(exitstatus)}\n")
        sys.stdout.flush()


@pytest.fixture(scope="session")
def hvd() -> Any:
    """The public API as a Horovod script sees it (``import hvd_slim as hvd``), with the
    runtime's extra queries (``backend``, ``job_comm``, ``world_transport``)."""
    import hvd_slim
    from hvd_slim import runtime
    ns = types.SimpleNamespace()
    for module in (runtime, hvd_slim):
        for key in dir(module):
            if not key.startswith("_"):
                setattr(ns, key, getattr(module, key))
    return ns


@pytest.fixture
def sets(hvd: Any) -> Any:
    """The even and odd ranks' process sets, removed afterwards (checked)."""
    n = hvd.size()
    even = hvd.add_process_set(list(range(0, n, 2)))
    odd = hvd.add_process_set(list(range(1, n, 2)))
    yield even, odd
    assert hvd.remove_process_set(even) and even.process_set_id is None
    assert hvd.remove_process_set(odd) and odd.process_set_id is None
