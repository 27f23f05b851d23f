"""Run a command under ``mpirun`` with a hard timeout (used by the convergence study and tests).

A hung MPI job must never hang its caller: the job runs in a session of its own; on timeout
mpirun gets SIGTERM (it then tears its ranks down), then every process left in the session
gets SIGKILL.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A launcher's per-process variables would make a nested mpirun think it is a rank itself.
_STRIP = ("OMPI_COMM_WORLD_", "OMPI_UNIVERSE_SIZE", "PMI_", "PMIX_", "HOROVOD_RANK",
          "HOROVOD_SIZE", "HOROVOD_LOCAL_", "HOROVOD_CROSS_")


class MpiTimeout(RuntimeError):
    """The job outlived its timeout and was killed; ``output`` holds what it printed."""

    def __init__(self, message: str, output: str) -> None:
        super().__init__(message)
        self.output = output


def mpirun_argv(np_: int, command: List[str], mpi_args: Sequence[str] = ()) -> List[str]:
    """``mpirun`` for ``np_`` ranks on one machine with fewer cores than ranks; ``mpi_args``
    (e.g. the emulated network's ``--mca btl tcp,self ...``) go before the command."""
    return ["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none",
            # Containers often forbid the single-copy mechanism (CMA); plain shared memory works.
            "--mca", "btl_vader_single_copy_mechanism", "none", *mpi_args,
            "-x", "PYTHONPATH", "-x", "PYTHONDONTWRITEBYTECODE", *command]


def run(np_: int, command: List[str], timeout: float, capture: bool = True,
        mpi_args: Sequence[str] = (), prefix: Sequence[str] = ()) -> Tuple[int, str]:
    """Run ``command`` on ``np_`` ranks from the repository root; return (exit code, output).

    With ``capture=False`` the output goes to this process's stdout/stderr and "" is returned.
    ``mpi_args`` are extra mpirun options; ``prefix`` is put before mpirun (e.g. ``ip netns
    exec NS``). Raises :class:`MpiTimeout` after killing the job if it runs longer than
    ``timeout`` s; any other exception here (Ctrl-C, SIGTERM turned into SystemExit) kills the
    job too before it propagates.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIP)}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONDONTWRITEBYTECODE="1",  # ranks would race writing the same .pyc files
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    pipe: Optional[int] = subprocess.PIPE if capture else None
    proc = subprocess.Popen([*prefix, *mpirun_argv(np_, command, mpi_args)], cwd=ROOT, env=env,
                            stdout=pipe, stderr=subprocess.STDOUT if capture else None,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = _kill(proc)
        raise MpiTimeout(f"`{' '.join(command)}` on {np_} ranks did not finish within "
                         f"{timeout:.0f}s and was killed", out) from None
    except BaseException:
        _kill(proc)
        raise
    return proc.returncode, (out or b"").decode(errors="replace")


def _session(sid: int) -> List[int]:
    """Processes in session ``sid``: Open MPI gives each rank a process group of its own, so
    only the session (which ``start_new_session`` made) holds mpirun and every rank."""
    pids = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[3]) == sid:
                pids.append(int(entry))
    return pids


def _kill(proc: subprocess.Popen) -> str:
    """SIGTERM mpirun (it tears its ranks down), then SIGKILL what is left of its session."""
    try:
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        out = None
    for pid in [proc.pid] + _session(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if out is None:
        out, _ = proc.communicate()
    return (out or b"").decode(errors="replace")


if __name__ == "__main__":  # e.g. python examples/launch.py 2 60 python -c "print(1)"
    rc, text = run(int(sys.argv[1]), sys.argv[3:], float(sys.argv[2]), capture=False)
    sys.exit(rc)
