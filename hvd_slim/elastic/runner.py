"""``run``: Horovod's elastic retry loop around a training function.

Each try first syncs the state from rank 0, then calls the function. A communication failure
(:func:`~hvd_slim.elastic.errors.is_internal`: HorovodInternalError, or hvd_slim's
TransportError/TransportTimeout) restores the last commit, rebuilds hvd_slim on the surviving
ranks (:func:`hvd_slim.elastic.recovery.recover`), calls the state's reset callbacks and tries
again. A :class:`HostsUpdatedInterrupt` keeps the state and the communicator and only re-syncs
(unless it says ``skip_sync``). Any other exception propagates: uncaught, it still ends the
whole job (:mod:`hvd_slim.runtime.abort`).
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, TypeVar

from ..runtime import basics
from . import recovery
from .errors import HostsUpdatedInterrupt, is_internal
from .state import State

R = TypeVar("R")


def run_fn(func: Callable[..., R], reset: Callable[[], Any]) -> Callable[..., R]:
    """The loop of :func:`run` with its reset (rebuilding the communicator) passed in, so that it
    can be tested without MPI."""
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> R:
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
            except Exception as exc:  # noqa: BLE001 - re-raised unless it is a comm failure
                if not is_internal(exc):
                    raise
                sys.stderr.write(f"hvd_slim.elastic: {type(exc).__name__}: {exc}; restoring the "
                                 "last commit and rebuilding on the surviving ranks\n")
                sys.stderr.flush()
                # Horovod's order: restore, reset, the reset callbacks, sync.
                state.restore()
                skip_sync = False
                reset()
            state.on_reset()
    return wrapper


def run(func: Callable[..., R]) -> Callable[..., R]:
    """Decorator: run ``func(state, ...)`` elastically, as ``horovod.torch.elastic.run``.

    On a communication failure every surviving rank restores ``state``'s last commit, hvd_slim
    is rebuilt on the ranks still alive (a dead rank is dropped: launch with
    ``mpirun --enable-recovery``), ``state.on_reset()`` runs and ``func`` is called again after
    a ``state.sync()`` from the lowest surviving rank. Call no collective before the first
    commit outside ``func``; as in Horovod, ``func`` must not be a collective itself.

    Args:
        func: The training function; its first argument is a :class:`State`.

    Returns:
        The wrapped function, taking the same arguments and returning what ``func`` returns.
        Under torchrun calling it raises RuntimeError: rebuilding on the survivors needs MPI
        (torchrun restarts the whole job instead: ``--max-restarts``).
    """
    loop = run_fn(func, _reset)

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> R:
        if basics.is_initialized() and basics.backend() == "torch":
            raise basics.needs_mpi(
                "hvd.elastic.run", "after a rank is lost, the survivors rebuild the job's MPI "
                "communicator among themselves (mpirun --enable-recovery); under torchrun, "
                "restart the whole job instead (torchrun --max-restarts N) and resume from a "
                "checkpoint")
        return loop(state, *args, **kwargs)
    return wrapper


def _reset() -> None:
    survivors = recovery.recover()
    sys.stderr.write(f"hvd_slim.elastic: continuing on COMM_WORLD ranks {survivors}; this is "
                     f"rank {basics.rank()} of {basics.size()}\n")
    sys.stderr.flush()
