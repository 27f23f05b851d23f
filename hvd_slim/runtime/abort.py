"""Abort the whole MPI job when any rank dies of an uncaught exception.

Without this, a rank that raises simply exits while its peers wait forever in their next
collective, and ``mpirun`` hangs. The hooks print which rank failed and why, flush, and call
``MPI.COMM_WORLD.Abort(1)`` so the job ends with a non-zero status.
"""
from __future__ import annotations

import atexit
import sys
import threading
import traceback
from types import TracebackType
from typing import Any, Callable, Optional, Type

_installed = False
_end_at_exit: Optional[str] = None   # why this process must not finalise MPI normally


def _world() -> Optional[tuple]:
    """(rank, size, mpi module) when MPI is up and the job has more than one rank, else None."""
    mpi = sys.modules.get("hvd_slim.transport.mpi_comm")
    if mpi is None:
        return None
    try:
        rank, size = mpi.world_rank_size()
    except Exception:  # noqa: BLE001 - MPI finalised or broken: fall back to the plain hook
        return None
    return (rank, size, mpi) if size > 1 else None


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not stop the abort
            pass


def _report_and_abort(exc_type: Type[BaseException], exc: Optional[BaseException],
                      tb: Optional[TracebackType], where: str) -> bool:
    """Print the failure and abort the job; returns False (nothing done) for a one-rank job."""
    world = _world()
    if world is None:
        return False
    rank, size, mpi = world
    lines = traceback.format_exception(exc_type, exc, tb)
    sys.stderr.write(f"hvd_slim: rank {rank} of {size} failed with {exc_type.__name__}: {exc}{where}\n"
                     + "".join(lines)
                     + f"hvd_slim: aborting all {size} ranks (MPI.COMM_WORLD.Abort(1))\n")
    _flush()
    mpi.abort_world(1)
    return True


def _call_quietly(hook: Callable[..., Any], *args: Any) -> None:
    try:
        hook(*args)
    except Exception:  # noqa: BLE001 - a failing user hook must not prevent the abort
        pass


def install() -> None:
    """Chain abort-all-ranks handlers in front of ``sys.excepthook`` and ``threading.excepthook``.
    Idempotent: a second call (e.g. ``init()`` after ``shutdown()``) installs nothing more."""
    global _installed
    if _installed:
        return
    _installed = True
    previous_sys: Callable[..., Any] = sys.excepthook
    previous_thread: Callable[..., Any] = threading.excepthook

    def sys_hook(exc_type: Type[BaseException], exc: BaseException, tb: Optional[TracebackType]) -> None:
        # Ctrl-C reaches every rank from mpirun anyway; let it exit normally.
        if issubclass(exc_type, KeyboardInterrupt) or _world() is None:
            previous_sys(exc_type, exc, tb)
            return
        # A user's own hook (logging, crash reporting) still runs; the default one would only
        # print the traceback a second time.
        if previous_sys is not sys.__excepthook__:
            _call_quietly(previous_sys, exc_type, exc, tb)
        _report_and_abort(exc_type, exc, tb, "")

    def thread_hook(args: Any) -> None:
        # A thread ended by SystemExit is not a failure (the default hook ignores it too).
        if issubclass(args.exc_type, SystemExit) or _world() is None:
            previous_thread(args)
            return
        if previous_thread is not threading.__excepthook__:
            _call_quietly(previous_thread, args)
        _report_and_abort(args.exc_type, args.exc_value, args.exc_traceback,
                          f" (in thread {getattr(args.thread, 'name', '?')!r})")

    sys.excepthook = sys_hook
    threading.excepthook = thread_hook


def end_job_at_exit(reason: str) -> None:
    """A collective was abandoned (it timed out): MPI cannot finalise cleanly any more, and the
    peers may still wait in it. If this process reaches exit anyway (the error was caught),
    end the whole job there with MPI Abort, saying why, instead of hanging in MPI_Finalize."""
    global _end_at_exit
    if _end_at_exit is None:
        # mpi4py finalises MPI through Py_AtExit, which runs after every atexit handler.
        atexit.register(_abort_at_exit)
    _end_at_exit = reason


def forgive_abandoned() -> None:
    """Undo :func:`end_job_at_exit`: the job went on without the abandoned collectives (elastic
    recovery rebuilt hvd_slim on new communicators), so exit may finalise MPI normally."""
    global _end_at_exit
    _end_at_exit = None


def _abort_at_exit() -> None:
    world = _world()
    if world is None or _end_at_exit is None:
        return
    rank, size, mpi = world
    sys.stderr.write(f"hvd_slim: rank {rank} of {size} reached exit after a collective timed out "
                     f"({_end_at_exit}); ending all {size} ranks (MPI.COMM_WORLD.Abort(1)): MPI "
                     "cannot finalise with that collective pending\n")
    _flush()
    mpi.abort_world(1)
