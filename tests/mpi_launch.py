"""Launching jobs from the test suite: ``mpirun`` (or ``horovodrun``) in a session of its own,
under a hard timeout after which the whole session is killed, so a hung job fails its test
instead of hanging the suite. Used by the MPI, Horovod and GPU tier launchers and by
tests/unit/test_reliability_launch.py.

(Not ``launch.py``: examples/launch.py is imported as ``launch`` by tests that put examples/ on
``sys.path``, and one process cannot hold two modules of that name.)

Environment: ``HVD_SLIM_MPIRUN_ARGS`` replaces the default MCA arguments (shared memory + TCP,
no single-copy mechanism, which containers often forbid), e.g. ``--mca btl self,tcp``.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MPIRUN_ARGS = ("--mca pml ob1 --mca btl self,vader,tcp "
                       "--mca btl_vader_single_copy_mechanism none")
# A launcher's per-process variables would make a nested mpirun think it is a rank itself.
STRIP = ("OMPI_COMM_WORLD_", "OMPI_UNIVERSE_SIZE", "PMI_", "PMIX_", "HOROVOD_RANK", "HOROVOD_SIZE",
         "HOROVOD_LOCAL_", "HOROVOD_CROSS_",
         # torchrun's: hvd_slim reads RANK/WORLD_SIZE as a launcher too (and MASTER_* in rendezvous)
         "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def session_env(drop: Sequence[str] = ()) -> Dict[str, str]:
    """This environment without launcher variables (nor any starting with a prefix in ``drop``),
    plus what mpirun needs as root and what the ranks need to import hvd_slim from here."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(STRIP + tuple(drop))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONDONTWRITEBYTECODE="1",  # ranks would race writing the same .pyc files
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return env


def run_mpi(np_: int, command: List[str], timeout: float,
            extra_env: Optional[Dict[str, str]] = None, drop: Sequence[str] = ()
            ) -> Tuple[int, str, float]:
    """Run ``command`` on ``np_`` ranks (oversubscribed, unbound); returns (exit code, combined
    output, seconds). ``extra_env`` is set for (and exported to) every rank; ``drop`` as in
    :func:`session_env`. A run that outlives ``timeout`` is killed whole and fails the test."""
    extra_env = extra_env or {}
    argv = ["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none",
            *shlex.split(os.environ.get("HVD_SLIM_MPIRUN_ARGS", DEFAULT_MPIRUN_ARGS)),
            "-x", "PYTHONPATH", "-x", "PYTHONDONTWRITEBYTECODE",
            *[arg for name in extra_env for arg in ("-x", name)], *command]
    return run_session(argv, timeout, {**session_env(drop), **extra_env})


def run_session(argv: List[str], timeout: float, env: Dict[str, str]) -> Tuple[int, str, float]:
    """Run ``argv`` from the repository root with exactly ``env``, in a session of its own; on
    timeout kill the whole session and fail the test. Returns (exit code, output, seconds)."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc)
        out, _ = proc.communicate()
        pytest.fail(f"`{shlex.join(argv)}` did not finish within {timeout:.0f}s and was killed "
                    f"(a hang?); output tail:\n{tail(out.decode(errors='replace'))}")
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


def kill_session(proc: subprocess.Popen) -> None:
    """Stop a hung launcher: SIGTERM so it can tear its ranks down, then SIGKILL whatever is
    left of its process group and session."""
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


def tail(text: str, lines: int = 80) -> str:
    """The last ``lines`` lines of ``text``."""
    return "\n".join(text.splitlines()[-lines:])
