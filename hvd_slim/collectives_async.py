"""The ``*_async`` variants of the Horovod collectives, ``poll`` and ``synchronize``. They
complete before they return (hvd_slim's collectives are eager) and hand back a handle that maps
to the finished output until ``synchronize`` releases it.
"""
from __future__ import annotations

import itertools
from typing import Any, Dict, Optional

import torch

from .collective_ops import _allgather, _allreduce, _broadcast, _resolve_op
from .collectives import allreduce_, broadcast_
from .runtime.checks import check_tensor_args

# Async variants complete eagerly; the handle maps to the finished output until synchronize().
_handles: Dict[int, torch.Tensor] = {}
_next_handle = itertools.count(1)


def _handle(result: torch.Tensor) -> int:
    handle = next(_next_handle)
    _handles[handle] = result
    return handle


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[int] = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: Any = None) -> int:
    """:func:`allreduce` (without compression) behind a handle.

    The reduction runs, collectively, before this returns, with :func:`allreduce`'s checks and
    errors (not differentiable); the handle keeps the result until :func:`synchronize`.

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
    """
    check_tensor_args("allreduce_async", tensor, name)
    op = _resolve_op("allreduce_async", op, average)
    return _handle(_allreduce(tensor, op, prescale_factor, postscale_factor, name, "allreduce_async",
                              process_set=process_set))


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[int] = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set: Any = None) -> int:
    """:func:`allreduce_` behind a handle: ``tensor`` is reduced in place before this returns.

    Collective, with :func:`allreduce_`'s checks; its errors are worded as ``allreduce_``'s.

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
    return _handle(allreduce_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None, process_set: Any = None) -> int:
    """:func:`allgather` behind a handle; it runs, collectively, before this returns.

    Same checks and errors as :func:`allgather`; not differentiable.

    Args:
        tensor: This rank's dense tensor.
        name: Optional str naming the tensor in error messages.
        process_set: The :class:`ProcessSet` to run on (default None: every rank); only
            its ranks call this.

    Returns:
        An int handle; :func:`synchronize` returns the concatenated tensor.
    """
    check_tensor_args("allgather_async", tensor, name)
    return _handle(_allgather(tensor, name, "allgather_async", process_set)[0])


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: Any = None) -> int:
    """:func:`broadcast` behind a handle; it runs, collectively, before this returns.

    Same checks and errors as :func:`broadcast`; not differentiable.

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
    return _handle(_broadcast(tensor, root_rank, name, "broadcast_async", process_set=process_set))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: Any = None) -> int:
    """:func:`broadcast_` behind a handle: ``tensor`` is overwritten before this returns.

    Collective, with :func:`broadcast_`'s checks; its errors are worded as ``broadcast_``'s.

    Args:
        tensor: The root's value; on the other ranks, the tensor to overwrite.
        root_rank: The sending rank, an int in ``[0, size())``.
        name: Optional str naming the tensor in error messages.
        process_set: The :class:`ProcessSet` to run on (default None: every rank); only
            its ranks call this.

    Returns:
        An int handle; :func:`synchronize` returns ``tensor`` itself.
    """
    return _handle(broadcast_(tensor, root_rank, name, process_set))


def poll(handle: int) -> bool:
    """Whether the operation behind ``handle`` has finished. Local: no communication.

    Args:
        handle: A handle from an ``*_async`` call not yet passed to :func:`synchronize`.

    Returns:
        Always True: every ``*_async`` operation has completed by the time it returns.

    Raises:
        ValueError: ``handle`` is unknown or was already synchronized.
    """
    if handle not in _handles:
        raise ValueError(f"poll: unknown handle {handle!r}; it was not returned by an *_async call "
                         f"or was already passed to synchronize()")
    return True


def synchronize(handle: int) -> Optional[torch.Tensor]:
    """Hand back the output of the operation behind ``handle`` and release the handle.

    Local (the operation already ran); until then the handle keeps its output alive.

    Args:
        handle: A handle from an ``*_async`` call.

    Returns:
        The operation's output tensor (the input tensor itself for ``allreduce_async_`` and
        ``broadcast_async_``), or None for a handle that is unknown or already synchronized,
        as in Horovod (no error is raised).
    """
    return _handles.pop(handle, None)
