"""Launching MPI jobs that must never hang their caller: the convergence study, the exchange
benchmark and every test tier start their jobs here (tests/mpi_launch.py adapts it to pytest).

A job runs from the repository root in a session of its own. On timeout its launcher gets
SIGTERM (mpirun then tears its ranks down), then every process left in the session gets SIGKILL:
Open MPI gives each rank a process group of its own, so only the session holds them all.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A launcher's per-process variables would make a nested mpirun think it is a rank itself;
# torchrun's too: hvd_slim reads RANK/WORLD_SIZE as a launcher (and MASTER_* in rendezvous).
STRIP = ("OMPI_COMM_WORLD_", "OMPI_UNIVERSE_SIZE", "PMI_", "PMIX_", "HOROVOD_RANK",
         "HOROVOD_SIZE", "HOROVOD_LOCAL_", "HOROVOD_CROSS_",
         "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Containers often forbid the single-copy mechanism (CMA); plain shared memory works.
NO_SINGLE_COPY = ("--mca", "btl_vader_single_copy_mechanism", "none")


class MpiTimeout(RuntimeError):
    """The job outlived its timeout and was killed; ``output`` holds what it printed."""

    def __init__(self, message: str, output: str) -> None:
        super().__init__(message)
        self.output = output


def session_env(drop: Sequence[str] = ()) -> Dict[str, str]:
    """This environment without launcher variables (nor any starting with a prefix in ``drop``),
    plus what mpirun needs as root and what the ranks need to import this repository's code."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(STRIP + tuple(drop))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONDONTWRITEBYTECODE="1",  # ranks would race writing the same .pyc files
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    return env


def mpirun_argv(np_: int, command: Sequence[str], mpi_args: Sequence[str] = NO_SINGLE_COPY,
                export: Sequence[str] = ()) -> List[str]:
    """``mpirun`` for ``np_`` ranks on one machine with fewer cores than ranks: oversubscribed
    and unbound, ``mpi_args`` (MCA options) before the command, PYTHONPATH and the variables
    named in ``export`` exported to every rank."""
    return ["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none", *mpi_args,
            "-x", "PYTHONPATH", "-x", "PYTHONDONTWRITEBYTECODE",
            *[arg for name in export for arg in ("-x", name)], *command]


def run_session(argv: Sequence[str], timeout: float, env: Dict[str, str], capture: bool = True
                ) -> Tuple[int, str, float]:
    """Run ``argv`` from the repository root with exactly ``env``, in a session of its own.

    Returns (exit code, combined output, seconds); with ``capture=False`` the output goes to
    this process's stdout/stderr and "" is returned. Raises :class:`MpiTimeout` after killing
    the whole session if it runs longer than ``timeout`` s; any other exception here (Ctrl-C,
    SIGTERM turned into SystemExit) kills it too before it propagates.
    """
    start = time.monotonic()
    pipe: Optional[int] = subprocess.PIPE if capture else None
    proc = subprocess.Popen(list(argv), cwd=ROOT, env=env, stdout=pipe,
                            stderr=subprocess.STDOUT if capture else None, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise MpiTimeout(f"`{' '.join(argv)}` did not finish within {timeout:.0f}s and was "
                         f"killed", kill_session(proc)) from None
    except BaseException:
        kill_session(proc)
        raise
    return proc.returncode, (out or b"").decode(errors="replace"), time.monotonic() - start


def run(np_: int, command: List[str], timeout: float, capture: bool = True,
        mpi_args: Sequence[str] = (), prefix: Sequence[str] = ()) -> Tuple[int, str]:
    """Run ``command`` on ``np_`` ranks (see :func:`run_session`); returns (exit code, output).
    ``mpi_args`` are MCA options besides :data:`NO_SINGLE_COPY`; ``prefix`` goes before
    mpirun (e.g. ``ip netns exec NS``)."""
    argv = [*prefix, *mpirun_argv(np_, command, (*NO_SINGLE_COPY, *mpi_args))]
    rc, out, _ = run_session(argv, timeout, session_env(), capture)
    return rc, out


def _session_members(sid: int) -> List[int]:
    """The processes of session ``sid`` (none where there is no /proc)."""
    members = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[3]) == sid:
                members.append(int(entry))
    return members


def kill_session(proc: subprocess.Popen) -> str:
    """Stop a job: SIGTERM to its launcher's group so it can tear its ranks down, then SIGKILL
    whatever is left of the session. Returns what the job printed, if it was captured."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)   # not communicate(): a surviving rank keeps the pipe open
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for pid in [proc.pid] + _session_members(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out, _ = proc.communicate()
    return (out or b"").decode(errors="replace")


if __name__ == "__main__":  # python -m benchmarks.launch 2 60 python -c "print(1)"
    sys.exit(run(int(sys.argv[1]), sys.argv[3:], float(sys.argv[2]), capture=False)[0])
