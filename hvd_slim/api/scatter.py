"""Horovod's ``reducescatter`` and ``reducescatter_async``, and the fused reduce-scatter of a list
of tensors that ``grouped_reducescatter`` shares (api/grouped.py).

Dim 0 is split as Horovod splits it: with ``n`` rows over ``size`` ranks, every rank gets
``n // size`` rows and the first ``n % size`` ranks one more, in rank order. The tensors of one
dtype travel in one MPI ``Ireduce_scatter`` over a flat buffer laid out as Horovod's fusion
buffer is (rank 0's rows of every tensor, then rank 1's, ...). Only ``Average`` and ``Sum``
reduce-scatter, as in Horovod (its other ops raise NotImplementedError, a RuntimeError).
float16 and bfloat16 are reduced in float32, rounded to their dtype after the prescale as
Horovod's half-precision buffers are.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .async_ops import _queued
from .checks import agree_many, check_tensor_args, label
from .compression import Compression
from .fused import allgather_many
from .ops import (_HALF, _MPI_OPS, _REDUCIBLE, Adasum, Average, Max, Min, Product, Sum,
                  _differentiable, _host_copy, _scale_, on_group)
from .process_sets import resolve

__all__ = ["reducescatter", "reducescatter_async"]


def check_scatter_op(what: str, op: Any) -> int:
    """``op`` as Average or Sum; Horovod's other ops raise NotImplementedError, others ValueError."""
    if op in (Average, Sum) and not isinstance(op, bool):
        return int(op)
    if op in (Adasum, Min, Max, Product) and not isinstance(op, bool):
        raise NotImplementedError(f"{what}: reducescatter only supports hvd.Average and hvd.Sum (as "
                                  f"in Horovod), got op={op!r}")
    raise ValueError(f"{what}: op={op!r} is not hvd.Average or hvd.Sum")


def split_rows(n: int, size: int) -> Tuple[List[int], List[int]]:
    """Horovod's split of ``n`` rows over ``size`` ranks: every rank's (start, count)."""
    base, extra = divmod(n, size)
    counts = [base + (1 if r < extra else 0) for r in range(size)]
    starts = [r * base + min(r, extra) for r in range(size)]
    return starts, counts


def reducescatter_many(tensors: Sequence[torch.Tensor], op: int, prescale: float, postscale: float,
                       name: Optional[str], what: str, process_set: Any = None) -> List[torch.Tensor]:
    """Reduce-scatter every tensor of ``tensors`` (one cross-rank check, one MPI message per
    dtype); returns this rank's block of each, on its device and in its dtype."""
    with on_group(f"{what}{label(name)}", process_set) as (api, group):
        agree_many(api, what, name, tensors, {"op": op})
        for i, t in enumerate(tensors):
            if t.dim() == 0:
                raise ValueError(f"{what}{label(name)}: tensor {i} is 0-d and cannot be scattered "
                                 f"along dim 0; pass a tensor with at least one dimension")
            if (torch.float32 if t.dtype in _HALF else t.dtype) not in _REDUCIBLE:
                raise TypeError(f"{what}{label(name)}: cannot reduce dtype {t.dtype} (tensor {i}); "
                                f"use a floating point or integer tensor")
        size, me = group.size, group.rank
        outs: List[Optional[torch.Tensor]] = [None] * len(tensors)
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            idx = [i for i, t in enumerate(tensors) if t.dtype == dtype]
            work = torch.float32 if dtype in _HALF else dtype
            splits = [split_rows(tensors[i].shape[0], size) for i in idx]
            row = [int(np.prod(tensors[i].shape[1:], dtype=np.int64)) for i in idx]
            with torch.no_grad():
                flat = [tensors[i].detach().reshape(tensors[i].shape[0], k) for i, k in zip(idx, row)]
                parts = [f.narrow(0, s[0][r], s[1][r]).reshape(-1)
                         for r in range(size) for f, s in zip(flat, splits)]
                send = _host_copy(torch.cat(parts) if parts else torch.empty(0, dtype=dtype), work)
                _scale_(send, prescale)
                if dtype in _HALF and prescale != 1:
                    send.copy_(send.to(dtype))
                counts = np.array([sum(s[1][r] * k for s, k in zip(splits, row)) for r in range(size)],
                                  dtype=np.int64)
                recv = torch.empty(int(counts[me]), dtype=work)
                api.reduce_scatter(send.numpy(), recv.numpy(), counts, _MPI_OPS[op])
                _scale_(recv, postscale, size if op == Average else 1)
                start = 0
                for i, s, k in zip(idx, splits, row):
                    n = s[1][me] * k
                    shape = (s[1][me], *tensors[i].shape[1:])
                    outs[i] = recv[start:start + n].reshape(shape).to(tensors[i].device, dtype)
                    start += n
    return outs  # type: ignore[return-value]


class _ReducescatterFn(torch.autograd.Function):
    """Differentiable reduce-scatter with Horovod's gradient: the allgather of the output's
    gradient, times ``size`` for ``Sum`` and times the scale factors."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: int, pre: float, post: float, name: Optional[str],
                process_set: Any) -> torch.Tensor:
        ctx.args = (op, pre, post, name, process_set)
        return reducescatter_many([tensor], op, pre, post, name, "reducescatter", process_set)[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        op, pre, post, name, ps = ctx.args
        return (gather_grads([grad], op, pre, post, name, "reducescatter (backward)", ps)[0],
                None, None, None, None, None)


def gather_grads(grads: Sequence[torch.Tensor], op: int, pre: float, post: float, name: Optional[str],
                 what: str, process_set: Any) -> List[torch.Tensor]:
    """Horovod's reduce-scatter gradient of each of ``grads``, gathered in one message."""
    factor = (resolve(what, process_set).size if op == Sum else 1) * pre * post
    scaled = [g * factor if factor != 1 else g for g in grads]
    return allgather_many(scaled, name, what, process_set)


class GroupedReducescatterFn(torch.autograd.Function):
    """Differentiable grouped reduce-scatter, with Horovod's gradient (its gradient: :func:`gather_grads`)."""

    @staticmethod
    def forward(ctx: Any, op: int, pre: float, post: float, name: Optional[str], process_set: Any,
                *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.args = (op, pre, post, name, process_set)
        return tuple(reducescatter_many(tensors, op, pre, post, name, "grouped_reducescatter",
                                        process_set))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        op, pre, post, name, ps = ctx.args
        back = gather_grads(grads, op, pre, post, name, "grouped_reducescatter (backward)", ps)
        return (None, None, None, None, None, *back)


def _check(what: str, tensor: Any, name: Any, compression: Any, op: Any, prescale_factor: Any,
           postscale_factor: Any) -> int:
    check_tensor_args(what, tensor, name)
    for arg, value in (("prescale_factor", prescale_factor), ("postscale_factor", postscale_factor)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{what}: {arg} must be a float, got {type(value).__name__}")
    if compression is not None and not (hasattr(compression, "compress")
                                        and hasattr(compression, "decompress")):
        raise TypeError(f"{what}: compression must be a Horovod compressor such as "
                        f"hvd.Compression.none, got {type(compression).__name__}")
    return check_scatter_op(what, op)


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression: Any = Compression.none,
                  op: int = Average, process_set: Any = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks and hand each rank its block of dim 0.

    Collective: every rank passes the same dtype, shape and op (else the same
    :class:`MismatchError` on every rank). With ``n`` rows over ``size`` ranks, each rank
    gets ``n // size`` rows and the first ``n % size`` ranks one more, as in Horovod.
    Differentiable, with Horovod's gradient: the allgather of the output's gradient, times
    ``size`` for ``Sum``, times both scale factors.

    Args:
        tensor: This rank's dense tensor with at least one dimension (floating point or
            integer).
        name: Optional str naming the tensor in error messages; calls are matched by order.
        compression: A Horovod compressor (default ``Compression.none``), applied before the
            reduction and undone after it.
        op: ``Average`` (default) or ``Sum``.
        process_set: The :class:`ProcessSet` to run on (default None: every rank); only its
            ranks call this, and blocks go by position in the set.
        prescale_factor: Multiplies each rank's tensor before the reduction (default 1.0).
        postscale_factor: Multiplies the reduced block (default 1.0); ``Average`` divides by
            the number of ranks after it. Integers are scaled in float64, truncated to zero.

    Returns:
        A new tensor of the input's dtype and device: this rank's rows of the reduction.

    Raises:
        ValueError: a 0-d tensor, an unknown op, neither hvd_slim nor Horovod initialised, or
            arguments that differ between ranks (a :class:`MismatchError`, also a RuntimeError).
        NotImplementedError: ``op`` is ``Adasum``, ``Min``, ``Max`` or ``Product`` (a
            RuntimeError, as Horovod raises).
        TypeError: ``tensor`` is not a dense torch.Tensor, ``name`` is not a str, a scale
            factor is not a number or ``compression`` not a compressor.
        TransportTimeout: a rank did not arrive within ``HVD_SLIM_TIMEOUT`` seconds.
    """
    op = _check("reducescatter", tensor, name, compression, op, prescale_factor, postscale_factor)
    sent, ctx = compression.compress(tensor)
    if _differentiable(sent):
        out = _ReducescatterFn.apply(sent, op, prescale_factor, postscale_factor, name, process_set)
    else:
        out = reducescatter_many([sent], op, prescale_factor, postscale_factor, name,
                                 "reducescatter", process_set)[0]
    return compression.decompress(out, ctx)


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: int = Average,
                        process_set: Any = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """:func:`reducescatter` (without compression) behind a handle.

    Queued: it runs collectively in the background, in its turn, with :func:`reducescatter`'s
    checks; its errors are raised by :func:`synchronize`. Not differentiable.

    Args:
        tensor: This rank's dense tensor with at least one dimension.
        name: Optional str naming the tensor in error messages.
        op: ``Average`` (default) or ``Sum``.
        process_set: The :class:`ProcessSet` to run on (default None: every rank).
        prescale_factor: Multiplies each rank's tensor before the reduction (default 1.0).
        postscale_factor: Multiplies the reduced block (default 1.0).

    Returns:
        An int handle; :func:`synchronize` returns this rank's block of the reduction.

    Raises:
        ValueError: as :func:`reducescatter`.
        NotImplementedError: ``op`` is another Horovod op than ``Average`` or ``Sum``.
        TypeError: as :func:`reducescatter`.
    """
    op = _check("reducescatter_async", tensor, name, None, op, prescale_factor, postscale_factor)
    return _queued("reducescatter_async", name, process_set, lambda: reducescatter_many(
        [tensor], op, prescale_factor, postscale_factor, name, "reducescatter_async",
        process_set)[0])
