"""Launch the distributed tier (tests/distributed) under mpirun, one pytest process per rank, and
check that a failure on one rank ends the whole job instead of hanging it.

Environment:
* ``HVD_SLIM_TEST_NP``: comma-separated world sizes, default ``2,3``.
* ``HVD_SLIM_TEST_TIMEOUT``: seconds before a tier run is killed as hung, default 600.
* ``HVD_SLIM_MPIRUN_ARGS``: replaces the default MCA arguments (shared memory + TCP, no
  single-copy mechanism, which containers often forbid), e.g. ``--mca btl self,tcp``.
* ``HVD_SLIM_TEST_TRANSPORTS``: the exchange transports the tier runs over, default ``mpi,gloo``
  (each pass sets ``HVD_SLIM_TRANSPORT`` for every rank).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
try:
    NPS = [int(x) for x in os.environ.get("HVD_SLIM_TEST_NP", "2,3").split(",") if x.strip()]
except ValueError:
    raise ValueError(f"HVD_SLIM_TEST_NP={os.environ['HVD_SLIM_TEST_NP']!r} must be a comma-separated "
                     f"list of world sizes, e.g. 2,3") from None
TIMEOUT = float(os.environ.get("HVD_SLIM_TEST_TIMEOUT", "600"))
TRANSPORTS = [x.strip() for x in os.environ.get("HVD_SLIM_TEST_TRANSPORTS", "mpi,gloo").split(",")
              if x.strip()]
ABORT_TIMEOUT = 120.0
DEFAULT_MPIRUN_ARGS = "--mca pml ob1 --mca btl self,vader,tcp --mca btl_vader_single_copy_mechanism none"
# A launcher's per-process variables would make a nested mpirun think it is a rank itself.
_STRIP = ("OMPI_COMM_WORLD_", "OMPI_UNIVERSE_SIZE", "PMI_", "PMIX_", "HOROVOD_RANK", "HOROVOD_SIZE",
          "HOROVOD_LOCAL_", "HOROVOD_CROSS_",
          # torchrun's: hvd_slim reads RANK/WORLD_SIZE as a launcher too (and MASTER_* in rendezvous)
          "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

pytestmark = [
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun is not installed"),
    pytest.mark.skipif(__import__("importlib").util.find_spec("mpi4py") is None,
                       reason="mpi4py is not installed"),
]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIP)}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONDONTWRITEBYTECODE="1",  # ranks would race writing the same .pyc files
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return env


def run_mpi(np_: int, command: List[str], timeout: float,
            extra_env: Optional[Dict[str, str]] = None) -> Tuple[int, str, float]:
    """Run ``command`` on ``np_`` ranks; returns (exit code, combined output, seconds). A run
    that outlives ``timeout`` has its whole process group killed and fails the test.
    ``extra_env`` is set for (and exported to) every rank."""
    extra_env = extra_env or {}
    argv = ["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none",
            *shlex.split(os.environ.get("HVD_SLIM_MPIRUN_ARGS", DEFAULT_MPIRUN_ARGS)),
            "-x", "PYTHONPATH", "-x", "PYTHONDONTWRITEBYTECODE",
            *[arg for name in extra_env for arg in ("-x", name)], *command]
    return run_session(argv, timeout, extra_env)


def run_session(argv: List[str], timeout: float, extra_env: Dict[str, str]
                ) -> Tuple[int, str, float]:
    """Run ``argv`` in a session of its own; on timeout kill the whole session and fail.
    Returns (exit code, combined output, seconds)."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, env={**_env(), **extra_env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        out, _ = proc.communicate()
        pytest.fail(f"`{shlex.join(argv)}` did not finish within {timeout:.0f}s and was killed (a hang?); "
                    f"output tail:\n{_tail(out.decode(errors='replace'))}")
    return proc.returncode, out.decode(errors="replace"), time.monotonic() - start


def _session_members(sid: int) -> List[int]:
    """Processes in session ``sid``. Open MPI puts every rank in a process group of its own, so
    killing mpirun's group alone would leave the ranks running; the session holds them all."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[3]) == sid:
                members.append(int(entry.name))
    return members


def _kill_session(proc: subprocess.Popen) -> None:
    """Stop a hung mpirun: SIGTERM so it can tear its ranks down, then SIGKILL whatever is left of
    its process group and session."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for pid in [proc.pid] + (_session_members(proc.pid) if Path("/proc").is_dir() else []):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _tail(text: str, lines: int = 80) -> str:
    return "\n".join(text.splitlines()[-lines:])


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("np_", NPS)
def test_distributed_tier(np_: int, transport: str) -> None:
    """The whole tier, once per exchange transport (HVD_SLIM_TRANSPORT, which every
    DistributedOptimizer there picks up when it passes no transport=)."""
    rc, out, _ = run_mpi(np_, [sys.executable, "-m", "pytest", "tests/distributed", "-q",
                               "-p", "no:cacheprovider", "--color=no"], TIMEOUT,
                         extra_env={"HVD_SLIM_TRANSPORT": transport})
    summaries = {int(m.group(1)): (int(m.group(2)), int(m.group(3)), int(m.group(4)))
                 for m in re.finditer(rf"hvd_slim-tier: rank (\d+) of {np_} passed=(\d+) failed=(\d+) "
                                      rf"skipped=\d+ exitstatus=(\d+)", out)}
    problem = None
    if rc != 0:
        problem = f"mpirun exited with {rc}"
    elif sorted(summaries) != list(range(np_)):
        problem = f"ranks {sorted(set(range(np_)) - set(summaries))} did not report a summary"
    elif any(failed or status for _, failed, status in summaries.values()):
        problem = f"a rank reported failures: {summaries}"
    elif len({passed for passed, _, _ in summaries.values()}) != 1 or summaries[0][0] == 0:
        problem = f"the ranks passed different (or zero) numbers of tests: {summaries}"
    assert problem is None, (f"distributed tier at -np {np_} over {transport}: {problem}; output "
                             f"tail:\n{_tail(out)}")


@pytest.mark.parametrize("mode", ["main", "thread"])
@pytest.mark.parametrize("np_", [n for n in NPS if n >= 2] or [2])
def test_exception_on_one_rank_ends_the_job(np_: int, mode: str) -> None:
    script = ROOT / "tests" / "scripts" / "raise_on_one_rank.py"
    rc, out, elapsed = run_mpi(np_, [sys.executable, str(script), mode], ABORT_TIMEOUT)
    context = f"-np {np_} ({mode}), exit {rc} after {elapsed:.1f}s; output tail:\n{_tail(out)}"
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
        "from hvd_slim.functions import barrier\n\n"
        "def test_rank_one_fails():\n"
        "    assert rt.rank() != 1, 'planted failure on rank 1'\n"
        "    barrier()\n\n"
        "def test_after():\n"
        "    barrier()\n")
    rc, out, elapsed = run_mpi(2, [sys.executable, "-m", "pytest", str(tmp_path), "-q", "-p",
                                   "no:cacheprovider", "--color=no"], ABORT_TIMEOUT)
    context = f"exit {rc} after {elapsed:.1f}s; output tail:\n{_tail(out)}"
    assert rc != 0 and elapsed < ABORT_TIMEOUT / 2, context
    assert "rank 1: FAILED" in out and "test_rank_one_fails" in out and "planted failure" in out, context
