"""Launch the torchrun tier (tests/torchrun: ``hvd.init()`` on torch.distributed, no MPI) at 2
and 3 processes, one pytest process per rank, and check that a failure on one rank ends the
whole job naming it, as does a rank that skips a tensor-API collective (the others time out
after HVD_SLIM_TIMEOUT naming it). Every job runs under a hard timeout in a session of its own
(tests/mpi_launch.py): a hang fails the test with the output's tail.

Environment:
* ``HVD_SLIM_TEST_NP``: comma-separated world sizes, default ``2,3`` (as the MPI tier).
* ``HVD_SLIM_TEST_TIMEOUT``: seconds before a tier run is killed as hung, default 600.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Dict, List, Optional, Tuple

import pytest
import torch.distributed as dist

from tests.mpi_launch import ROOT, run_session, session_env, tail
from tests.rank_tier import check_skipped_collective, tier_problem

NPS = [int(x) for x in os.environ.get("HVD_SLIM_TEST_NP", "2,3").split(",") if x.strip()]
TIMEOUT = float(os.environ.get("HVD_SLIM_TEST_TIMEOUT", "600"))
ABORT_TIMEOUT = 120.0
# The optimizer tests expect "auto" (Gloo here); a job's own torchrun state must not leak in.
DROP = ("HVD_SLIM_TRANSPORT", "HVD_SLIM_TIMEOUT", "TORCHELASTIC_", "GROUP_RANK", "ROLE_")

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with Gloo is not available")


def run_torchrun(np_: int, command: List[str], timeout: float,
                 extra_env: Optional[Dict[str, str]] = None) -> Tuple[int, str, float]:
    """``command`` (arguments to ``python``) on ``np_`` processes under torchrun on this
    machine; (exit code, combined output, seconds). Outliving ``timeout`` fails the test."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(np_), "--max-restarts", "0", *command]
    return run_session(argv, timeout, {**session_env(DROP), **(extra_env or {})})


@pytest.mark.parametrize("np_", NPS)
def test_torchrun_tier(np_: int) -> None:
    rc, out, _ = run_torchrun(np_, ["-m", "pytest", "tests/torchrun", "-q", "-p",
                                    "no:cacheprovider", "--color=no"], TIMEOUT,
                              {"HVD_SLIM_TORCHRUN_TIER": "1"})
    problem = tier_problem("hvd_slim-torchrun-tier", np_, rc, out, "torchrun")
    assert problem is None, f"torchrun tier at {np_} processes: {problem}; output tail:\n{tail(out)}"


@pytest.mark.parametrize("mode", ["main", "thread", "gloo"])
def test_exception_on_one_rank_ends_the_job(mode: str) -> None:
    """Rank 1 raises (in the main thread, in a worker thread, or after an optimizer transport
    started) while the others wait in a collective: the job ends, non-zero, naming rank 1;
    the ranks that waited say why their collective failed."""
    np_ = max(NPS)
    script = str(ROOT / "tests" / "scripts" / "raise_on_one_rank.py")
    rc, out, elapsed = run_torchrun(np_, [script, mode], ABORT_TIMEOUT)
    context = f"{np_} processes ({mode}), exit {rc} after {elapsed:.1f}s; output tail:\n{tail(out)}"
    assert rc != 0 and elapsed < ABORT_TIMEOUT / 2, context
    assert (f"hvd_slim: rank 1 of {np_} failed with RuntimeError: deliberate failure on rank 1"
            in out), f"the failing rank and message are not reported: {context}"
    assert "hvd_slim: ending rank 1 with exit status 1 (the launcher, torchrun, stops the other " \
           f"{np_ - 1} rank(s))" in out, context
    assert "Traceback" in out and "unreachable" not in out, context
    # A rank that was still waiting names the failed one in its own error, if torchrun had not
    # stopped it first.
    for line in re.findall(r"hvd_slim: rank [02] of \d failed with TransportError: (.*)", out):
        assert f"rank 1 of {np_} failed with RuntimeError: deliberate failure" in line, context


_SKIP_CASES = [(n, "allreduce", False) for n in NPS] + [(max(NPS), "barrier", True)]
_LABELS = {"allreduce": "allreduce of 'skipped'", "barrier": "barrier"}


@pytest.mark.parametrize("np_,op,catch", _SKIP_CASES)
def test_a_skipped_api_collective_times_the_others_out(np_: int, op: str, catch: bool) -> None:
    """The last rank skips a tensor-API call and stays alive: after HVD_SLIM_TIMEOUT every other
    rank raises a TransportTimeout naming the call and the missing rank, and the job ends,
    also when the ranks catch the error and exit normally."""
    timeout = 3
    script = str(ROOT / "tests" / "scripts" / "skip_collective.py")
    rc, out, elapsed = run_torchrun(np_, [script, op] + ["catch"] * catch, ABORT_TIMEOUT,
                                    {"HVD_SLIM_TIMEOUT": str(timeout)})
    context = f"{np_} processes ({op}), exit {rc} after {elapsed:.1f}s; output tail:\n{tail(out)}"
    assert rc != 0 and elapsed < ABORT_TIMEOUT / 2, context
    check_skipped_collective(out, np_, _LABELS[op], timeout, catch,
                             r"Gloo \w+ \(collective #\d+ on this group\)", context)
    assert "ending rank" in out, context
