"""End the whole job when any rank dies of an uncaught exception.

Without this, a rank that raises simply exits while its peers wait forever in their next
collective, and ``mpirun`` hangs. The hooks print which rank failed and why, flush, and end the
job with a non-zero status: under MPI with ``MPI.COMM_WORLD.Abort(1)``; under an ``env://``
launcher (torchrun, :mod:`hvd_slim.runtime.torch_world`) by leaving with status 1, which makes
torchrun stop the other ranks, after writing the message to the job's store, where the ranks
waiting in a collective read it (:mod:`hvd_slim.transport.torch_api`): their errors name the
failed rank even where no launcher ends them.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from types import TracebackType
from typing import Any, Callable, NamedTuple, Optional, Type

_installed = False
_end_at_exit: Optional[str] = None   # why this process must not finalise MPI normally
_skip_finalize: Optional[str] = None   # why this process must leave without MPI_Finalize
_exit_code: Any = 0   # what sys.exit was last given, for a process that leaves with os._exit


class _World(NamedTuple):
    """A job of more than one rank: this process's place in it and how to end it all."""
    rank: int
    size: int
    how: str                       # how the job is ended, for the message
    end: Callable[[str], None]     # given the message; does not return


class _Launched(NamedTuple):
    """A job started by an ``env://`` launcher (:func:`use_launcher_world`)."""
    rank: int
    size: int
    note: Callable[[str], None]


_launched: Optional[_Launched] = None


def use_launcher_world(rank: int, size: int, note: Callable[[str], None]) -> None:
    """hvd_slim runs on torch.distributed as ``rank`` of ``size`` (runtime/torch_world.py):
    ending the job means leaving with status 1 (the launcher stops the other ranks), after
    ``note(message)`` has told them why."""
    global _launched
    _launched = _Launched(rank, size, note)


def forget_launcher_world() -> None:
    """``shutdown`` under an ``env://`` launcher: an exception now ends this process only."""
    global _launched
    _launched = None


def _world() -> Optional[_World]:
    """How to end the job when it has more than one rank, else None: MPI's Abort when MPI is
    up, else the launcher's when hvd_slim runs on torch.distributed."""
    mpi = sys.modules.get("hvd_slim.transport.mpi_comm")
    if mpi is not None:
        try:
            rank, size = mpi.world_rank_size()
        except Exception:  # noqa: BLE001 - MPI finalised or broken: fall back to the plain hook
            size = 0
        if size > 1:
            return _World(rank, size, f"aborting all {size} ranks (MPI.COMM_WORLD.Abort(1))",
                          lambda text: mpi.abort_world(1))
    launched = _launched
    if launched is None or launched.size < 2:
        return None
    return _World(launched.rank, launched.size,
                  f"ending rank {launched.rank} with exit status 1 (the launcher, torchrun, "
                  f"stops the other {launched.size - 1} rank(s))",
                  lambda text: _leave(launched, text))


def _leave(launched: _Launched, text: str) -> None:
    """Tell the other ranks why (the job's store), then leave at once: exit handlers could
    wait on the peers, or on a collective that never completes."""
    _call_quietly(launched.note, text)
    if "logging" in sys.modules:
        _call_quietly(sys.modules["logging"].shutdown)
    _flush()
    os._exit(1)


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
    lines = traceback.format_exception(exc_type, exc, tb)
    first = f"rank {world.rank} of {world.size} failed with {exc_type.__name__}: {exc}{where}"
    _say(f"hvd_slim: {first}\n" + "".join(lines) + f"hvd_slim: {world.how}\n")
    _flush()
    world.end(first)
    return True


def end_job(text: str) -> None:
    """Print ``text`` and end the whole job now, as an uncaught exception would (MPI's Abort,
    or under torchrun exit status 1 after telling the other ranks why); a one-rank job just
    leaves with status 1. For a caller that knows the job cannot go on (a test tier's failed
    test, while the other ranks wait in a collective)."""
    _say(text.rstrip("\n") + "\n")
    world = _world()
    if world is None:
        _flush()
        os._exit(1)
    _say(f"hvd_slim: {world.how}\n")
    _flush()
    world.end(f"rank {world.rank} of {world.size}: {text.strip().splitlines()[0]}"
              if text.strip() else f"rank {world.rank} of {world.size} ended the job")


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
    """A collective was abandoned (it timed out): MPI cannot finalise cleanly any more (nor
    torch.distributed tear down its group), and the peers may still wait in it. If this process
    reaches exit anyway (the error was caught), end the whole job there (MPI Abort, or exit
    status 1 under torchrun), saying why, instead of hanging in MPI_Finalize."""
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
    first = (f"rank {world.rank} of {world.size} reached exit after a collective timed out "
             f"({_end_at_exit})")
    _say(f"hvd_slim: {first}; {world.how}: the job cannot end cleanly with that collective "
         "pending\n")
    _flush()
    world.end(first)


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
