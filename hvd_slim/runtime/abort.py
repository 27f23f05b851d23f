"""Abort the whole MPI job when any rank dies of an uncaught exception.

Without this, a rank that raises simply exits while its peers wait forever in their next
collective, and ``mpirun`` hangs. The hooks print which rank failed and why, flush, and call
``MPI.COMM_WORLD.Abort(1)`` so the job ends with a non-zero status.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from types import TracebackType
from typing import Any, Callable, Optional, Type

_installed = False
_end_at_exit: Optional[str] = None   # why this process must not finalise MPI normally
_skip_finalize: Optional[str] = None   # why this process must leave without MPI_Finalize
_exit_code: Any = 0   # what sys.exit was last given, for a process that leaves with os._exit


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


def _say(text: str) -> None:
    """Write ``text`` where the user will see it before the job ends: ``sys.stderr``, and the
    process's own stderr too when something swapped ``sys.stderr`` out (torch.distributed's
    excepthook runs the chained hooks into a StringIO it prints only after they return, and
    they never return here)."""
    for stream in {id(s): s for s in (sys.stderr, sys.__stderr__) if s is not None}.values():
        try:
            stream.write(text)
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not stop the abort
            pass


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
    _say(f"hvd_slim: rank {rank} of {size} failed with {exc_type.__name__}: {exc}{where}\n"
         + "".join(lines) + f"hvd_slim: aborting all {size} ranks (MPI.COMM_WORLD.Abort(1))\n")
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
    _say(f"hvd_slim: rank {rank} of {size} reached exit after a collective timed out "
         f"({_end_at_exit}); ending all {size} ranks (MPI.COMM_WORLD.Abort(1)): MPI "
         "cannot finalise with that collective pending\n")
    _flush()
    mpi.abort_world(1)


def leave_without_finalize(reason: str) -> None:
    """Ranks of this MPI job died and the job went on without them (elastic recovery): Open MPI's
    ``MPI_Finalize`` fences over every process the job started, and with a dead one it can wait
    forever. So this process leaves at exit with ``os._exit`` instead, after Python's other exit
    handlers that were registered after this call and after flushing the standard streams and
    ``logging``. Its status is what ``sys.exit`` was given, else 0 (an uncaught exception has
    already ended the job through the abort hook). ``mpirun --enable-recovery``, which such a
    job needs anyway, accepts a process that leaves without finalising."""
    global _skip_finalize
    if _skip_finalize is None:
        atexit.register(_leave_at_exit)
        previous = sys.exit

        def exit_and_remember(status: Any = None) -> None:
            global _exit_code
            _exit_code = status
            previous(status)

        sys.exit = exit_and_remember
    _skip_finalize = reason


def _status(code: Any) -> int:
    """The process status Python gives ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1   # Python has printed the message already


def _leave_at_exit() -> None:
    if _skip_finalize is None:
        return
    if "logging" in sys.modules:
        _call_quietly(sys.modules["logging"].shutdown)
    status = _status(_exit_code)
    _flush()
    os._exit(status)
