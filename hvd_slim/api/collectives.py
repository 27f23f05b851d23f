"""Horovod-shaped tensor collectives: the reduce ops and allreduce / allgather / broadcast
with their in-place variants (the ``*_async`` ones, ``poll`` and ``synchronize`` are in
api/async_ops.py). Collectives run eagerly over MPI on the job communicator
(api/ops.py says how); ``join``, ``barrier`` and the object and parameter helpers live in
:mod:`hvd_slim.api.functions`.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .checks import check_tensor_args
from .compression import Compression
from .ops import (Adasum, Average, Max, Min, Product, Sum, _allgather, _AllgatherFn, _allreduce,
                  _AllreduceFn, _broadcast, _BroadcastFn, _differentiable, _resolve_op)

__all__ = ["Average", "Sum", "Adasum", "Min", "Max", "Product", "allreduce", "allreduce_",
           "allgather", "broadcast", "broadcast_"]


# ---- public API ---------------------------------------------------------------------------

def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Any = Compression.none, op: Optional[int] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks (by default the average) into a new tensor.

    Collective: every rank calls it, in the same order, with the same dtype, shape and op (a
    mismatch raises the same ValueError on every rank). Differentiable: the gradient is reduced
    with the same op and factors. CUDA tensors are staged through host memory; float16 and
    bfloat16 are reduced in float32.

    Args:
        tensor: This rank's dense tensor (floating point or integer; bool and complex raise
            TypeError).
        average: Deprecated Horovod flag (DeprecationWarning): True means ``op=Average``,
            False ``op=Sum``. Passing it together with ``op`` raises ValueError.
        name: Optional str naming the tensor in error messages; calls are matched by order.
        compression: A Horovod compressor (default ``Compression.none``): the tensor is
            compressed before the reduction and decompressed after it.
        op: ``Average`` (default when ``average`` is also None), ``Sum``, ``Min``, ``Max``,
            ``Product`` or ``Adasum`` (floating point only, on a power-of-two number of ranks,
            else NotImplementedError: see :mod:`hvd_slim.api.adasum`); anything else raises
            ValueError.
        prescale_factor: Multiplies each rank's tensor before the reduction (default 1.0).
        postscale_factor: Multiplies the reduced result (default 1.0); ``Average`` divides by
            ``size()`` after it. Integer tensors are scaled in float64, truncated toward zero.
        process_set: The :class:`ProcessSet` to run on (default None: every rank); only
            its ranks call this.

    Returns:
        A new tensor of the input's shape, dtype and device holding the reduction.

    Raises:
        ValueError: neither hvd_slim nor Horovod is initialised, or an argument is bad or
            differs between ranks (see above).
        TypeError: ``tensor`` is not a dense torch.Tensor, or ``name`` is not a str.
        TransportTimeout: a rank did not arrive within ``HVD_SLIM_TIMEOUT`` seconds.
    """
    check_tensor_args("allreduce", tensor, name)
    op = _resolve_op("allreduce", op, average)
    sent, ctx = compression.compress(tensor)
    if _differentiable(sent):
        out = _AllreduceFn.apply(sent, op, prescale_factor, postscale_factor, name, process_set)
    else:
        out = _allreduce(sent, op, prescale_factor, postscale_factor, name, "allreduce",
                         process_set=process_set)
    return compression.decompress(out, ctx)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks in place; :func:`allreduce` without compression.

    Collective, with :func:`allreduce`'s checks and errors. Not differentiable: the result is
    written into ``tensor``'s own memory.

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
        ``tensor`` itself, now holding the reduction.
    """
    check_tensor_args("allreduce_", tensor, name)
    op = _resolve_op("allreduce_", op, average)
    return _allreduce(tensor, op, prescale_factor, postscale_factor, name, "allreduce_", out=tensor,
                      process_set=process_set)


def allgather(tensor: torch.Tensor, name: Optional[str] = None, process_set: Any = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0, in rank order.

    Collective: the first dimension may differ between ranks; the dtype and the other
    dimensions may not (the same ValueError on every rank). A 0-d tensor counts as one row.
    Differentiable: the backward pass averages the gradient over ranks and hands each rank the
    rows it contributed.

    Args:
        tensor: This rank's dense tensor.
        name: Optional str naming the tensor in error messages.
        process_set: The :class:`ProcessSet` to run on (default None: every rank); only
            its ranks call this.

    Returns:
        A new tensor on the input's device whose first dimension is the sum of every rank's.

    Raises:
        ValueError: neither hvd_slim nor Horovod is initialised, ``process_set`` is not a
            registered set of this rank, or the ranks' dtypes or trailing dimensions differ
            (a :class:`MismatchError`, also a RuntimeError).
        TypeError: ``tensor`` is not a dense torch.Tensor, or ``name`` is not a str.
        TransportTimeout: a rank did not arrive within ``HVD_SLIM_TIMEOUT`` seconds.
    """
    check_tensor_args("allgather", tensor, name)
    if _differentiable(tensor):
        return _AllgatherFn.apply(tensor, name, process_set)
    return _allgather(tensor, name, "allgather", process_set)[0]


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: Any = None) -> torch.Tensor:
    """Return ``root_rank``'s value of ``tensor`` on every rank, as a new tensor.

    Collective: every rank passes the same ``root_rank``, dtype and shape (else the same
    ValueError on every rank). Differentiable: the root gets the gradient averaged over ranks,
    the other ranks get zeros.

    Args:
        tensor: The root's value to send; on the other ranks, a tensor of the same dtype and
            shape (its values are ignored).
        root_rank: The sending rank, an int in ``[0, size())`` (ValueError otherwise).
        name: Optional str naming the tensor in error messages.
        process_set: The :class:`ProcessSet` to run on (default None: every rank); only
            its ranks call this.

    Returns:
        A new tensor on the input's device holding the root's value.

    Raises:
        ValueError: neither hvd_slim nor Horovod is initialised, or an argument is bad or
            differs between ranks.
        TypeError: ``tensor`` is not a dense torch.Tensor, or ``name`` is not a str.
        TransportTimeout: a rank did not arrive within ``HVD_SLIM_TIMEOUT`` seconds.
    """
    check_tensor_args("broadcast", tensor, name)
    if _differentiable(tensor):
        return _BroadcastFn.apply(tensor, root_rank, name, process_set)
    return _broadcast(tensor, root_rank, name, "broadcast", process_set=process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: Any = None) -> torch.Tensor:
    """Overwrite ``tensor`` in place with ``root_rank``'s value.

    Collective, with :func:`broadcast`'s checks and errors; not differentiable.

    Args:
        tensor: The root's value; on the other ranks, the tensor to overwrite.
        root_rank: The sending rank, an int in ``[0, size())``.
        name: Optional str naming the tensor in error messages.
        process_set: The :class:`ProcessSet` to run on (default None: every rank); only
            its ranks call this.

    Returns:
        ``tensor`` itself, now holding the root's value.
    """
    check_tensor_args("broadcast_", tensor, name)
    return _broadcast(tensor, root_rank, name, "broadcast_", out=tensor, process_set=process_set)
