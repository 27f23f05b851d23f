"""Launch the distributed tier (tests/distributed) under mpirun, one pytest process per rank, and
check that a failure on one rank ends the whole job instead of hanging it, as does a rank that
skips a tensor-API collective (the others time out after HVD_SLIM_TIMEOUT).

Environment:
* ``HVD_SLIM_TEST_NP``: comma-separated world sizes, default ``2,3``.
* ``HVD_SLIM_TEST_TIMEOUT``: seconds before a tier run is killed as hung, default 600.
* ``HVD_SLIM_MPIRUN_ARGS``: replaces the default MCA arguments (see tests/mpi_launch.py, which
  runs every job in a session of its own and kills the session on timeout).
* ``HVD_SLIM_TEST_TRANSPORTS``: the exchange transports the tier runs over, default ``mpi,gloo``
  (each pass sets ``HVD_SLIM_TRANSPORT`` for every rank).
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.mpi_launch import ROOT, run_mpi, tail
from tests.rank_tier import check_skipped_collective, tier_problem

try:
    NPS = [int(x) for x in os.environ.get("HVD_SLIM_TEST_NP", "2,3").split(",") if x.strip()]
except ValueError:
    raise ValueError(f"HVD_SLIM_TEST_NP={os.environ['HVD_SLIM_TEST_NP']!r} must be a comma-separated "
                     f"list of world sizes, e.g. 2,3") from None
TIMEOUT = float(os.environ.get("HVD_SLIM_TEST_TIMEOUT", "600"))
TRANSPORTS = [x.strip() for x in os.environ.get("HVD_SLIM_TEST_TRANSPORTS", "mpi,gloo").split(",")
              if x.strip()]
ABORT_TIMEOUT = 120.0

pytestmark = [
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun is not installed"),
    pytest.mark.skipif(__import__("importlib").util.find_spec("mpi4py") is None,
                       reason="mpi4py is not installed"),
]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("np_", NPS)
def test_distributed_tier(np_: int, transport: str) -> None:
    """The whole tier, once per exchange transport (HVD_SLIM_TRANSPORT, which every
    DistributedOptimizer there picks up when it passes no transport=)."""
    rc, out, _ = run_mpi(np_, [sys.executable, "-m", "pytest", "tests/distributed", "-q",
                               "-p", "no:cacheprovider", "--color=no"], TIMEOUT,
                         extra_env={"HVD_SLIM_TRANSPORT": transport})
    problem = tier_problem("hvd_slim-tier", np_, rc, out, "mpirun")
    assert problem is None, (f"distributed tier at -np {np_} over {transport}: {problem}; output "
                             f"tail:\n{tail(out)}")


@pytest.mark.parametrize("mode", ["main", "thread", "gloo"])
@pytest.mark.parametrize("np_", [n for n in NPS if n >= 2] or [2])
def test_exception_on_one_rank_ends_the_job(np_: int, mode: str) -> None:
    script = ROOT / "tests" / "scripts" / "raise_on_one_rank.py"
    rc, out, elapsed = run_mpi(np_, [sys.executable, str(script), mode], ABORT_TIMEOUT)
    context = f"-np {np_} ({mode}), exit {rc} after {elapsed:.1f}s; output tail:\n{tail(out)}"
    assert rc != 0, f"the job should fail: {context}"
    assert elapsed < ABORT_TIMEOUT / 2, f"the abort took too long: {context}"
    assert (f"hvd_slim: rank 1 of {np_} failed with RuntimeError: deliberate failure on rank 1"
            in out), f"the failing rank and message are not reported: {context}"
    assert "Traceback" in out and "unreachable" not in out, context


def test_failed_test_on_one_rank_aborts_the_tier(tmp_path: Path) -> None:
    """The tier's conftest must end the job when a test fails on one rank while the others wait
    in a collective (here: a barrier that rank 1 never reaches)."""
    shutil.copy(ROOT / "tests" / "distributed" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_fails_on_rank_one.py").write_text(
        "import hvd_slim.runtime as rt\n"
        "from hvd_slim.api.functions import barrier\n\n"
        "def test_rank_one_fails():\n"
        "    assert rt.rank() != 1, 'planted failure on rank 1'\n"
        "    barrier()\n\n"
        "def test_after():\n"
        "    barrier()\n")
    rc, out, elapsed = run_mpi(2, [sys.executable, "-m", "pytest", str(tmp_path), "-q", "-p",
                                   "no:cacheprovider", "--color=no"], ABORT_TIMEOUT)
    context = f"exit {rc} after {elapsed:.1f}s; output tail:\n{tail(out)}"
    assert rc != 0 and elapsed < ABORT_TIMEOUT / 2, context
    assert "rank 1: FAILED" in out and "test_rank_one_fails" in out and "planted failure" in out, context


_SKIP_CASES = [(n, "allreduce", False) for n in NPS if n >= 2] or [(2, "allreduce", False)]
_SKIP_CASES += [(_SKIP_CASES[-1][0], op, catch) for op, catch in
                (("broadcast_object", False), ("barrier", False), ("allreduce", True))]
_LABELS = {"allreduce": "allreduce of 'skipped'", "broadcast_object": "broadcast_object ('skipped')",
           "barrier": "barrier"}


@pytest.mark.parametrize("np_,op,catch", _SKIP_CASES)
def test_a_skipped_api_collective_times_the_others_out(np_: int, op: str, catch: bool) -> None:
    """The last rank skips a tensor-API call and stays alive: after HVD_SLIM_TIMEOUT every other
    rank raises a TransportTimeout naming the call and the missing rank, and the job ends, also
    when the ranks catch the error and exit normally."""
    timeout = 3
    script = ROOT / "tests" / "scripts" / "skip_collective.py"
    rc, out, elapsed = run_mpi(np_, [sys.executable, str(script), op] + ["catch"] * catch,
                               ABORT_TIMEOUT, extra_env={"HVD_SLIM_TIMEOUT": str(timeout)})
    context = f"-np {np_} ({op}), exit {rc} after {elapsed:.1f}s; output tail:\n{tail(out)}"
    assert rc != 0 and elapsed < ABORT_TIMEOUT / 2, context
    check_skipped_collective(out, np_, _LABELS[op], timeout, catch,
                             r"MPI I\w+ \(collective #\d+ on this communicator\)", context)
