"""The ``*_async`` variants of the Horovod collectives, ``poll`` and ``synchronize``.

Each call is queued on the engine (:mod:`hvd_slim.api.engine`) and returns a handle at
once; the engine's thread runs it in order with every other tensor-API call, fusing queued
allreduces into one message, and :func:`synchronize` waits for it. Local argument errors
(a bad op, a duplicate name) raise at the call; errors of the collective itself (a mismatch
between ranks, a timeout) at :func:`synchronize`. Without MPI_THREAD_MULTIPLE they run as they
are called, and :func:`poll` is always True.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch

from . import engine
from .checks import check_tensor_args, label
from .ops import _allgather, _allreduce, _broadcast, _resolve_op


def _handle(result: Any) -> int:
    """A handle for a result computed already (for collectives run before they return)."""
    return engine.done_handle(result)


def _queued(what: str, name: Optional[str], process_set: Any, body: Callable[[], Any]) -> int:
    """Queue ``body`` (a synchronous collective, e.g. a grouped or reduce-scatter call) on the
    engine and return its handle at once: it runs in its turn on the engine's thread, where
    its own collectives run inline, and :func:`synchronize` hands back what it returns. The
    ranks check they queued the same call (by ``what``), and ``name`` joins the
    duplicate-name check."""
    def run(jobs: List[engine.Job], rnd: Any) -> None:
        jobs[0].result = body()
    return engine.submit(f"{what}{label(name)}", name, process_set, run)


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[int] = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: Any = None) -> int:
    """:func:`allreduce` (without compression) behind a handle.

    Queued: the reduction runs in the background, collectively, with :func:`allreduce`'s
    checks (not differentiable), fused with other queued allreduces of its dtype, op and
    factors; :func:`synchronize` returns the result or raises its error.

    Args:
        tensor: This rank's dense tensor.
        average: Deprecated flag, as in :func:`allreduce`.
        name: Optional str naming the tensor in error messages.
        op: The reduction, as in :func:`allreduce` (default ``Average``).
        prescale_factor: Multiplies each rank's tensor before the reduction (default 1.0).
        postscale_factor: Multiplies the reduced result (default 1.0).
        process_set: The :class:`ProcessSet` to run on (default None: every rank); only
            its ranks call this.

    Returns:
        An int handle; :func:`synchronize` returns the new reduced tensor.

    Raises:
        ValueError: a bad ``op`` or ``average``, or ``name`` is that of a call still pending.
        TypeError: ``tensor`` is not a dense torch.Tensor, or ``name`` is not a str.
    """
    check_tensor_args("allreduce_async", tensor, name)
    op = _resolve_op("allreduce_async", op, average)
    return _allreduce(tensor, op, prescale_factor, postscale_factor, name, "allreduce_async",
                      process_set=process_set, wait=False)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[int] = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set: Any = None) -> int:
    """:func:`allreduce_` behind a handle: ``tensor`` is reduced in place in the background.

    Queued as :func:`allreduce_async`; its errors are worded as ``allreduce_``'s. ``tensor``
    must not be touched until :func:`synchronize`.

    Args:
        tensor: The dense tensor to reduce and overwrite.
        average: Deprecated flag, as in :func:`allreduce`.
        name: Optional str naming the tensor in error messages.
        op: The reduction, as in :func:`allreduce` (default ``Average``).
        prescale_factor: Multiplies each rank's tensor before the reduction (default 1.0).
        postscale_factor: Multiplies the reduced result (default 1.0).
        process_set: The :class:`ProcessSet` to run on (default None: every rank); only
            its ranks call this.

    Returns:
        An int handle; :func:`synchronize` returns ``tensor`` itself.
    """
    check_tensor_args("allreduce_", tensor, name)
    op = _resolve_op("allreduce_", op, average)
    return _allreduce(tensor, op, prescale_factor, postscale_factor, name, "allreduce_", out=tensor,
                      process_set=process_set, wait=False)


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None, process_set: Any = None) -> int:
    """:func:`allgather` behind a handle; it runs, collectively, in the background.

    Same checks as :func:`allgather`, its errors raised by :func:`synchronize`; not
    differentiable.

    Args:
        tensor: This rank's dense tensor.
        name: Optional str naming the tensor in error messages.
        process_set: The :class:`ProcessSet` to run on (default None: every rank); only
            its ranks call this.

    Returns:
        An int handle; :func:`synchronize` returns the concatenated tensor.
    """
    check_tensor_args("allgather_async", tensor, name)
    return _allgather(tensor, name, "allgather_async", process_set, wait=False)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: Any = None) -> int:
    """:func:`broadcast` behind a handle; it runs, collectively, in the background.

    Same checks as :func:`broadcast`, its errors raised by :func:`synchronize`; not
    differentiable.

    Args:
        tensor: The root's value; on the other ranks, a tensor of the same dtype and shape.
        root_rank: The sending rank, an int in ``[0, size())``.
        name: Optional str naming the tensor in error messages.
        process_set: The :class:`ProcessSet` to run on (default None: every rank); only
            its ranks call this.

    Returns:
        An int handle; :func:`synchronize` returns a new tensor holding the root's value.
    """
    check_tensor_args("broadcast_async", tensor, name)
    return _broadcast(tensor, root_rank, name, "broadcast_async", process_set=process_set,
                      wait=False)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: Any = None) -> int:
    """:func:`broadcast_` behind a handle: ``tensor`` is overwritten in the background.

    Queued as :func:`broadcast_async`; its errors are worded as ``broadcast_``'s.

    Args:
        tensor: The root's value; on the other ranks, the tensor to overwrite.
        root_rank: The sending rank, an int in ``[0, size())``.
        name: Optional str naming the tensor in error messages.
        process_set: The :class:`ProcessSet` to run on (default None: every rank); only
            its ranks call this.

    Returns:
        An int handle; :func:`synchronize` returns ``tensor`` itself.
    """
    check_tensor_args("broadcast_", tensor, name)
    return _broadcast(tensor, root_rank, name, "broadcast_", out=tensor, process_set=process_set,
                      wait=False)


def poll(handle: int) -> bool:
    """Whether the operation behind ``handle`` has finished (successfully or not). Local: no
    communication.

    Args:
        handle: A handle from an ``*_async`` call not yet passed to :func:`synchronize`.

    Returns:
        True once the operation has completed, False while it is queued or running (always
        True where MPI lacks MPI_THREAD_MULTIPLE and calls run as they are made).

    Raises:
        ValueError: ``handle`` is unknown or was already synchronized.
    """
    return engine.poll(handle)


def synchronize(handle: int) -> Optional[torch.Tensor]:
    """Wait for the operation behind ``handle``, release the handle and hand back its output.

    Local: the operation runs collectively in the background; this only waits for it (each of
    its collectives waits at most ``HVD_SLIM_TIMEOUT`` seconds for the other ranks).

    Args:
        handle: A handle from an ``*_async`` call.

    Returns:
        The operation's output tensor (the input tensor itself for ``allreduce_async_`` and
        ``broadcast_async_``), or None for a handle that is unknown or already synchronized,
        as in Horovod (no error is raised).

    Raises:
        MismatchError: the ranks passed mismatched arguments (raised on every rank).
        TransportTimeout: a rank did not arrive within ``HVD_SLIM_TIMEOUT`` seconds.
        RuntimeError: the operation failed otherwise (e.g. an allgather or broadcast while a
            rank has joined), as raised by the operation.
    """
    return engine.synchronize(handle)
