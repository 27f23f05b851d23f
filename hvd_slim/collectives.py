"""Horovod-shaped tensor collectives: reduce ops, allreduce / allgather /
broadcast with their async and in-place variants, ``poll`` and ``synchronize``.

Collectives run eagerly over MPI on the job communicator, through the
:class:`~hvd_slim.transport.mpi_api.MpiCollectives` the runtime hands out
(:func:`~hvd_slim.runtime.basics.job_collectives`); ``*_async`` calls complete before they
return and hand back a handle for ``synchronize``. ``join``, ``barrier`` and the object and
parameter helpers live in :mod:`hvd_slim.functions`. Every call first allgathers a small signature
(dtype, shape, root or op) so that ranks passing mismatched tensors all raise the same clear error
instead of hanging or corrupting memory, and waits at most ``HVD_SLIM_TIMEOUT`` seconds for the
other ranks (:mod:`hvd_slim.runtime.api_timeout`). CUDA tensors are staged through host memory;
float16 and bfloat16 are reduced in float32, because MPI has no half-precision sum.
"""
from __future__ import annotations

import itertools
import warnings
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from .compression import Compression
from .runtime import basics
from .runtime.api_timeout import operation
from .runtime.checks import agree, check_root_rank, check_tensor_args, label

# Horovod's reduce-op values.
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_MPI_OPS = {Average: "sum", Sum: "sum", Min: "min", Max: "max", Product: "prod"}
_HALF = (torch.float16, torch.bfloat16)
_REDUCIBLE = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float32, torch.float64)


# ---- validation ---------------------------------------------------------------------------

def _resolve_op(what: str, op: Optional[int], average: Optional[bool]) -> int:
    """Horovod's handling of the deprecated ``average`` flag, then a check of ``op``."""
    if op is not None and average is not None:
        raise ValueError(f"{what}: the op parameter supersedes average; pass only one of them")
    if op is None:
        if average is not None:
            warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                          DeprecationWarning, stacklevel=3)
        op = Sum if average is False else Average
    if op == Adasum:
        raise ValueError(f"{what}: op=Adasum is not supported by hvd_slim; use hvd.Average or hvd.Sum")
    if op not in _MPI_OPS:
        raise ValueError(f"{what}: op={op!r} is not one of hvd.Average, hvd.Sum, hvd.Min, hvd.Max, "
                         f"hvd.Product")
    return op


# ---- implementations ----------------------------------------------------------------------

def _host_copy(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A fresh contiguous CPU copy (the staging buffer that MPI writes into)."""
    return torch.empty(t.shape, dtype=dtype or t.dtype).copy_(t.detach())


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view aliasing a contiguous CPU tensor's memory (any dtype, 0-d included)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _direct(t: Optional[torch.Tensor], dtype: torch.dtype) -> bool:
    """Whether MPI can work on ``t``'s own memory instead of a staged copy."""
    return t is not None and t.device.type == "cpu" and t.is_contiguous() and t.dtype == dtype


def _scale_(buf: torch.Tensor, factor: float, divisor: int = 1) -> None:
    """``buf *= factor / divisor`` in place; integers go through float64 and truncate toward zero,
    as in Horovod, dividing last so an exact average stays exact."""
    if factor == 1 and divisor == 1:
        return
    if buf.dtype.is_floating_point:
        buf.mul_(factor / divisor)
    else:
        buf.copy_(buf.to(torch.float64).mul_(factor).div_(divisor))


def _allreduce(tensor: torch.Tensor, op: int, prescale: float, postscale: float, name: Optional[str],
               what: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    size = basics.size()
    with operation(f"{what}{label(name)}", basics.job_collectives) as api:
        agree(api, what, name, tensor, {"op": op})
        work = torch.float32 if tensor.dtype in _HALF else tensor.dtype
        if work not in _REDUCIBLE:
            raise TypeError(f"{what}{label(name)}: cannot reduce dtype {tensor.dtype}; use a "
                            f"floating point or integer tensor")
        direct = _direct(out, work)
        with torch.no_grad():
            buf = out.detach() if direct else _host_copy(tensor, work)
            _scale_(buf, prescale)
            api.allreduce_inplace(buf.numpy(), _MPI_OPS[op])
            _scale_(buf, postscale, size if op == Average else 1)
            if out is None:
                return buf.to(device=tensor.device, dtype=tensor.dtype)
            if not direct:
                out.copy_(buf)
    return out


def _allgather(tensor: torch.Tensor, name: Optional[str], what: str) -> Tuple[torch.Tensor, np.ndarray]:
    """The concatenation along dim 0 (0-d tensors count as one row) and every rank's row count."""
    t = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    with operation(f"{what}{label(name)}", basics.job_collectives) as api:
        rows = agree(api, what, name, t, {}, dim0_free=True)
        host = t if _direct(t, t.dtype) else _host_copy(t)
        row_bytes = host.element_size() * int(np.prod(host.shape[1:], dtype=np.int64))
        out = torch.empty((int(rows.sum()), *t.shape[1:]), dtype=t.dtype)
        api.allgatherv_bytes(_bytes(host), rows * row_bytes, out=_bytes(out))
    return out.to(tensor.device), rows


def _broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str], what: str,
               out: Optional[torch.Tensor] = None, checked: bool = True) -> torch.Tensor:
    """Root's ``tensor`` as a new tensor, or written into ``out``. ``checked=False`` skips the
    cross-rank check, for callers that already made one for a whole batch of tensors."""
    root = check_root_rank(what, root_rank, basics.size())
    with operation(f"{what}{label(name)}", basics.job_collectives) as api:
        if checked:
            agree(api, what, name, tensor, {"root_rank": root})
        direct = _direct(out, tensor.dtype)
        with torch.no_grad():
            buf = out.detach() if direct else _host_copy(tensor)
            api.bcast_inplace(_bytes(buf), root)
            if out is None:
                return buf.to(tensor.device)
            if not direct:
                out.copy_(buf)
    return out


# Out-of-place collectives are differentiable, with Horovod's gradients.
class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: int, pre: float, post: float, name: Optional[str]) -> torch.Tensor:
        ctx.args = (op, pre, post, name)
        return _allreduce(tensor, op, pre, post, name, "allreduce")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        op, pre, post, name = ctx.args
        return _allreduce(grad, op, pre, post, name, "allreduce (backward)"), None, None, None, None


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str]) -> torch.Tensor:
        out, rows = _allgather(tensor, name, "allgather")
        ctx.name, ctx.shape, ctx.rows = name, tensor.shape, rows
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        reduced = _allreduce(grad, Average, 1.0, 1.0, ctx.name, "allgather (backward)")
        r = basics.rank()
        start = int(ctx.rows[:r].sum())
        return reduced.narrow(0, start, int(ctx.rows[r])).reshape(ctx.shape), None


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root: int, name: Optional[str]) -> torch.Tensor:
        ctx.root, ctx.name = root, name
        return _broadcast(tensor, root, name, "broadcast")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        reduced = _allreduce(grad, Average, 1.0, 1.0, ctx.name, "broadcast (backward)")
        return (reduced if basics.rank() == ctx.root else torch.zeros_like(reduced)), None, None


def _differentiable(tensor: torch.Tensor) -> bool:
    return tensor.requires_grad and torch.is_grad_enabled()


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
        op: ``Average`` (default when ``average`` is also None), ``Sum``, ``Min``, ``Max`` or
            ``Product``; ``Adasum`` and anything else raise ValueError.
        prescale_factor: Multiplies each rank's tensor before the reduction (default 1.0).
        postscale_factor: Multiplies the reduced result (default 1.0); ``Average`` divides by
            ``size()`` after it. Integer tensors are scaled in float64, truncated toward zero.
        process_set: Not supported: anything but None raises ValueError.

    Returns:
        A new tensor of the input's shape, dtype and device holding the reduction.

    Raises:
        ValueError: neither hvd_slim nor Horovod is initialised, or an argument is bad or
            differs between ranks (see above).
        TypeError: ``tensor`` is not a dense torch.Tensor, or ``name`` is not a str.
        TransportTimeout: a rank did not arrive within ``HVD_SLIM_TIMEOUT`` seconds.
    """
    check_tensor_args("allreduce", tensor, name, process_set)
    op = _resolve_op("allreduce", op, average)
    sent, ctx = compression.compress(tensor)
    if _differentiable(sent):
        out = _AllreduceFn.apply(sent, op, prescale_factor, postscale_factor, name)
    else:
        out = _allreduce(sent, op, prescale_factor, postscale_factor, name, "allreduce")
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
        process_set: Not supported: anything but None raises ValueError.

    Returns:
        ``tensor`` itself, now holding the reduction.
    """
    check_tensor_args("allreduce_", tensor, name, process_set)
    op = _resolve_op("allreduce_", op, average)
    return _allreduce(tensor, op, prescale_factor, postscale_factor, name, "allreduce_", out=tensor)


def allgather(tensor: torch.Tensor, name: Optional[str] = None, process_set: Any = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0, in rank order.

    Collective: the first dimension may differ between ranks; the dtype and the other
    dimensions may not (the same ValueError on every rank). A 0-d tensor counts as one row.
    Differentiable: the backward pass averages the gradient over ranks and hands each rank the
    rows it contributed.

    Args:
        tensor: This rank's dense tensor.
        name: Optional str naming the tensor in error messages.
        process_set: Not supported: anything but None raises ValueError.

    Returns:
        A new tensor on the input's device whose first dimension is the sum of every rank's.

    Raises:
        ValueError: neither hvd_slim nor Horovod is initialised, ``process_set`` is given, or
            the ranks' dtypes or trailing dimensions differ.
        TypeError: ``tensor`` is not a dense torch.Tensor, or ``name`` is not a str.
        TransportTimeout: a rank did not arrive within ``HVD_SLIM_TIMEOUT`` seconds.
    """
    check_tensor_args("allgather", tensor, name, process_set)
    if _differentiable(tensor):
        return _AllgatherFn.apply(tensor, name)
    return _allgather(tensor, name, "allgather")[0]


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
        process_set: Not supported: anything but None raises ValueError.

    Returns:
        A new tensor on the input's device holding the root's value.

    Raises:
        ValueError: neither hvd_slim nor Horovod is initialised, or an argument is bad or
            differs between ranks.
        TypeError: ``tensor`` is not a dense torch.Tensor, or ``name`` is not a str.
        TransportTimeout: a rank did not arrive within ``HVD_SLIM_TIMEOUT`` seconds.
    """
    check_tensor_args("broadcast", tensor, name, process_set)
    if _differentiable(tensor):
        return _BroadcastFn.apply(tensor, root_rank, name)
    return _broadcast(tensor, root_rank, name, "broadcast")


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: Any = None) -> torch.Tensor:
    """Overwrite ``tensor`` in place with ``root_rank``'s value.

    Collective, with :func:`broadcast`'s checks and errors; not differentiable.

    Args:
        tensor: The root's value; on the other ranks, the tensor to overwrite.
        root_rank: The sending rank, an int in ``[0, size())``.
        name: Optional str naming the tensor in error messages.
        process_set: Not supported: anything but None raises ValueError.

    Returns:
        ``tensor`` itself, now holding the root's value.
    """
    check_tensor_args("broadcast_", tensor, name, process_set)
    return _broadcast(tensor, root_rank, name, "broadcast_", out=tensor)


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
        process_set: Not supported: anything but None raises ValueError.

    Returns:
        An int handle; :func:`synchronize` returns the new reduced tensor.
    """
    check_tensor_args("allreduce_async", tensor, name, process_set)
    op = _resolve_op("allreduce_async", op, average)
    return _handle(_allreduce(tensor, op, prescale_factor, postscale_factor, name, "allreduce_async"))


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
        process_set: Not supported: anything but None raises ValueError.

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
        process_set: Not supported: anything but None raises ValueError.

    Returns:
        An int handle; :func:`synchronize` returns the concatenated tensor.
    """
    check_tensor_args("allgather_async", tensor, name, process_set)
    return _handle(_allgather(tensor, name, "allgather_async")[0])


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: Any = None) -> int:
    """:func:`broadcast` behind a handle; it runs, collectively, before this returns.

    Same checks and errors as :func:`broadcast`; not differentiable.

    Args:
        tensor: The root's value; on the other ranks, a tensor of the same dtype and shape.
        root_rank: The sending rank, an int in ``[0, size())``.
        name: Optional str naming the tensor in error messages.
        process_set: Not supported: anything but None raises ValueError.

    Returns:
        An int handle; :func:`synchronize` returns a new tensor holding the root's value.
    """
    check_tensor_args("broadcast_async", tensor, name, process_set)
    return _handle(_broadcast(tensor, root_rank, name, "broadcast_async"))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: Any = None) -> int:
    """:func:`broadcast_` behind a handle: ``tensor`` is overwritten before this returns.

    Collective, with :func:`broadcast_`'s checks; its errors are worded as ``broadcast_``'s.

    Args:
        tensor: The root's value; on the other ranks, the tensor to overwrite.
        root_rank: The sending rank, an int in ``[0, size())``.
        name: Optional str naming the tensor in error messages.
        process_set: Not supported: anything but None raises ValueError.

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

