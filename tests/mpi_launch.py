"""Launching jobs from the test suite: benchmarks/launch.py's sessions, where a job that outlives
its timeout fails its test (with its output's tail) instead of hanging the suite. Used by the
MPI, Horovod and GPU tier launchers and by the unit tests that start real processes.

Environment: ``HVD_SLIM_MPIRUN_ARGS`` replaces the default MCA arguments (shared memory + TCP,
no single-copy mechanism, which containers often forbid), e.g. ``--mca btl self,tcp``.
"""
from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

from benchmarks import launch
from benchmarks.launch import session_env

__all__ = ["ROOT", "run_mpi", "run_session", "session_env", "tail"]

ROOT = Path(launch.ROOT)
DEFAULT_MPIRUN_ARGS = ("--mca pml ob1 --mca btl self,vader,tcp "
                       "--mca btl_vader_single_copy_mechanism none")


def run_mpi(np_: int, command: List[str], timeout: float,
            extra_env: Optional[Dict[str, str]] = None, drop: Sequence[str] = ()
            ) -> Tuple[int, str, float]:
    """Run ``command`` on ``np_`` ranks (oversubscribed, unbound); returns (exit code, combined
    output, seconds). ``extra_env`` is set for (and exported to) every rank; ``drop`` as in
    :func:`benchmarks.launch.session_env`. A run that outlives ``timeout`` fails the test."""
    extra_env = extra_env or {}
    mca = shlex.split(os.environ.get("HVD_SLIM_MPIRUN_ARGS", DEFAULT_MPIRUN_ARGS))
    argv = launch.mpirun_argv(np_, command, mca, export=list(extra_env))
    return run_session(argv, timeout, {**launch.session_env(drop), **extra_env})


def run_session(argv: List[str], timeout: float, env: Dict[str, str]) -> Tuple[int, str, float]:
    """:func:`benchmarks.launch.run_session`, where a timeout fails the test (a hang?)."""
    try:
        return launch.run_session(argv, timeout, env)
    except launch.MpiTimeout as exc:
        pytest.fail(f"{exc} (a hang?); output tail:\n{tail(exc.output)}")


def tail(text: str, lines: int = 80) -> str:
    """The last ``lines`` lines of ``text``."""
    return "\n".join(text.splitlines()[-lines:])
