"""Horovod's grouped collectives: ``grouped_allreduce[_][_async][_]``, ``grouped_allgather[_async]``
and ``grouped_reducescatter[_async]``. One call handles a list of tensors with one cross-rank
check and fused MPI messages (api/fused.py): the tensors of one dtype are reduced in
one flat buffer, and an allgather moves every tensor in one message. The out-of-place forms are
differentiable, with the gradients of their single-tensor counterparts. The ``*_async`` forms
complete before they return and hand back a handle (as every hvd_slim ``*_async`` does).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

from .async_ops import _queued
from .checks import check_tensor_args
from .compression import Compression
from .fused import GroupedAllgatherFn, GroupedAllreduceFn, allgather_many, allreduce_many
from .ops import Average, _resolve_op
from .scatter import GroupedReducescatterFn
from .scatter import _check as _check_scatter
from .scatter import reducescatter_many

__all__ = ["grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
           "grouped_allreduce_async_", "grouped_allgather", "grouped_allgather_async",
           "grouped_reducescatter", "grouped_reducescatter_async"]


def _check_list(what: str, tensors: Any, name: Any) -> List[torch.Tensor]:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{what}: tensors must be a list or tuple of torch.Tensor, got "
                        f"{type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"{what}: tensors is empty; pass at least one tensor")
    for i, t in enumerate(tensors):
        check_tensor_args(f"{what} (tensor {i})", t, name)
    return list(tensors)


def _grad(tensors: Sequence[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: Any = Compression.none,
                      op: Optional[int] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = None) -> List[torch.Tensor]:
    """Reduce every tensor of a list over all ranks, as :func:`allreduce` does each, in one call.

    Collective: every rank passes as many tensors, with the same dtypes and shapes position by
    position, and the same op (else the same :class:`MismatchError` on every rank). All
    tensors must be on one device. Differentiable: the gradients are reduced the same way.

    Args:
        tensors: A non-empty list of dense tensors (dtypes may differ).
        average: Deprecated flag, as in :func:`allreduce`.
        name: Optional str naming the group in error messages.
        compression: A Horovod compressor (default ``Compression.none``), applied to each.
        op: ``Average`` (default), ``Sum``, ``Adasum``, ``Min``, ``Max`` or ``Product``;
            ``Adasum`` (floating point only) needs a power-of-two number of ranks.
        prescale_factor: Multiplies each tensor before the reduction (default 1.0).
        postscale_factor: Multiplies each result (default 1.0).
        process_set: The :class:`ProcessSet` to run on (default None: every rank).

    Returns:
        A list of new tensors, each of its input's shape, dtype and device.

    Raises:
        ValueError: an empty list, a bad op, or arguments that differ between ranks (a
            :class:`MismatchError`, also a RuntimeError).
        RuntimeError: the tensors are on different devices (as in Horovod).
        NotImplementedError: ``Adasum`` on a number of ranks that is not a power of two.
        TypeError: ``tensors`` is not a list of dense tensors, or a dtype cannot be reduced.
    """
    tensors = _check_list("grouped_allreduce", tensors, name)
    op = _resolve_op("grouped_allreduce", op, average)
    sent, ctxs = zip(*[compression.compress(t) for t in tensors])
    if _grad(sent):
        out = GroupedAllreduceFn.apply(op, prescale_factor, postscale_factor, name, process_set, *sent)
    else:
        out = allreduce_many(sent, op, prescale_factor, postscale_factor, name, "grouped_allreduce",
                             process_set=process_set)
    return [compression.decompress(t, c) for t, c in zip(out, ctxs)]


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[int] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = None) -> int:
    """:func:`grouped_allreduce` (without compression) behind a handle; it runs in the background, in its turn.

    Args:
        tensors: A non-empty list of dense tensors.
        average: Deprecated flag, as in :func:`allreduce`.
        name: Optional str naming the group in error messages.
        op: The reduction, as in :func:`grouped_allreduce` (default ``Average``).
        prescale_factor: Multiplies each tensor before the reduction (default 1.0).
        postscale_factor: Multiplies each result (default 1.0).
        process_set: The :class:`ProcessSet` to run on (default None: every rank).

    Returns:
        An int handle; :func:`synchronize` returns a tuple of new reduced tensors.

    Raises:
        ValueError: as :func:`grouped_allreduce`.
        TypeError: as :func:`grouped_allreduce`.
    """
    tensors = _check_list("grouped_allreduce_async", tensors, name)
    op = _resolve_op("grouped_allreduce_async", op, average)
    return _queued("grouped_allreduce_async", name, process_set, lambda: tuple(allreduce_many(
        tensors, op, prescale_factor, postscale_factor, name, "grouped_allreduce_async",
        process_set=process_set)))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[int] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = None) -> int:
    """:func:`grouped_allreduce_` behind a handle: the tensors are reduced in place before this
    returns.

    Args:
        tensors: A non-empty list of dense tensors to reduce and overwrite.
        average: Deprecated flag, as in :func:`allreduce`.
        name: Optional str naming the group in error messages.
        op: The reduction, as in :func:`grouped_allreduce` (default ``Average``).
        prescale_factor: Multiplies each tensor before the reduction (default 1.0).
        postscale_factor: Multiplies each result (default 1.0).
        process_set: The :class:`ProcessSet` to run on (default None: every rank).

    Returns:
        An int handle; :func:`synchronize` returns the tuple of the input tensors themselves.

    Raises:
        ValueError: as :func:`grouped_allreduce`.
        TypeError: as :func:`grouped_allreduce`.
    """
    tensors = _check_list("grouped_allreduce_async_", tensors, name)
    op = _resolve_op("grouped_allreduce_async_", op, average)
    return _queued("grouped_allreduce_async_", name, process_set, lambda: tuple(allreduce_many(
        tensors, op, prescale_factor, postscale_factor, name, "grouped_allreduce_async_",
        outs=tensors, process_set=process_set)))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Optional[int] = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = None) -> Tuple[torch.Tensor, ...]:
    """Reduce every tensor of a list in place; :func:`grouped_allreduce` without compression.

    Collective, with :func:`grouped_allreduce`'s checks; not differentiable.

    Args:
        tensors: A non-empty list of dense tensors to reduce and overwrite.
        average: Deprecated flag, as in :func:`allreduce`.
        name: Optional str naming the group in error messages.
        op: The reduction, as in :func:`grouped_allreduce` (default ``Average``).
        prescale_factor: Multiplies each tensor before the reduction (default 1.0).
        postscale_factor: Multiplies each result (default 1.0).
        process_set: The :class:`ProcessSet` to run on (default None: every rank).

    Returns:
        The tuple of the input tensors, now holding the reductions (as Horovod's).

    Raises:
        ValueError: as :func:`grouped_allreduce`.
        TypeError: as :func:`grouped_allreduce`.
    """
    tensors = _check_list("grouped_allreduce_", tensors, name)
    op = _resolve_op("grouped_allreduce_", op, average)
    return tuple(allreduce_many(tensors, op, prescale_factor, postscale_factor, name,
                                "grouped_allreduce_", outs=tensors, process_set=process_set))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: Any = None) -> Tuple[torch.Tensor, ...]:
    """Concatenate each tensor of a list with every rank's along dim 0, in one message.

    Collective: every rank passes as many tensors, with the same dtypes and trailing
    dimensions position by position; dim 0 may differ. Differentiable: each rank gets its
    rows of the gradient averaged over ranks, as :func:`allgather` does.

    Args:
        tensors: A non-empty list of dense tensors (0-d ones count as one row).
        name: Optional str naming the group in error messages.
        process_set: The :class:`ProcessSet` to run on (default None: every rank).

    Returns:
        A tuple of new tensors, one per input, each the concatenation in rank order.

    Raises:
        ValueError: an empty list, or mismatched tensors (a :class:`MismatchError`).
        TypeError: ``tensors`` is not a list of dense tensors.
    """
    tensors = _check_list("grouped_allgather", tensors, name)
    if _grad(tensors):
        return GroupedAllgatherFn.apply(name, process_set, *tensors)
    return tuple(allgather_many(tensors, name, "grouped_allgather", process_set))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: Any = None) -> int:
    """:func:`grouped_allgather` behind a handle; it runs in the background, in its turn.

    Args:
        tensors: A non-empty list of dense tensors.
        name: Optional str naming the group in error messages.
        process_set: The :class:`ProcessSet` to run on (default None: every rank).

    Returns:
        An int handle; :func:`synchronize` returns the tuple of gathered tensors.

    Raises:
        ValueError: as :func:`grouped_allgather`.
        TypeError: as :func:`grouped_allgather`.
    """
    tensors = _check_list("grouped_allgather_async", tensors, name)
    return _queued("grouped_allgather_async", name, process_set, lambda: tuple(allgather_many(
        tensors, name, "grouped_allgather_async", process_set)))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: Any = Compression.none, op: int = Average,
                          process_set: Any = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """Reduce-scatter each tensor of a list, as :func:`reducescatter` does each, fused by dtype.

    Collective, with :func:`reducescatter`'s rules for each tensor. Differentiable, with
    :func:`reducescatter`'s gradient.

    Args:
        tensors: A non-empty list of dense tensors, each with at least one dimension.
        name: Optional str naming the group in error messages.
        compression: A Horovod compressor (default ``Compression.none``), applied to each.
        op: ``Average`` (default) or ``Sum``.
        process_set: The :class:`ProcessSet` to run on (default None: every rank).
        prescale_factor: Multiplies each tensor before the reduction (default 1.0).
        postscale_factor: Multiplies each reduced block (default 1.0).

    Returns:
        A list of new tensors: this rank's block of each reduction.

    Raises:
        ValueError: an empty list, a 0-d tensor, or mismatched tensors.
        NotImplementedError: ``op`` is another Horovod op than ``Average`` or ``Sum``.
        TypeError: as :func:`reducescatter`.
    """
    tensors = _check_list("grouped_reducescatter", tensors, name)
    op = _check_scatter("grouped_reducescatter", tensors[0], name, compression, op,
                        prescale_factor, postscale_factor)
    sent, ctxs = zip(*[compression.compress(t) for t in tensors])
    if _grad(sent):
        out = GroupedReducescatterFn.apply(op, prescale_factor, postscale_factor, name, process_set,
                                           *sent)
    else:
        out = reducescatter_many(sent, op, prescale_factor, postscale_factor, name,
                                 "grouped_reducescatter", process_set)
    return [compression.decompress(t, c) for t, c in zip(out, ctxs)]


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                                op: int = Average, process_set: Any = None,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """:func:`grouped_reducescatter` (without compression) behind a handle; it runs before this
    returns.

    Args:
        tensors: A non-empty list of dense tensors, each with at least one dimension.
        name: Optional str naming the group in error messages.
        op: ``Average`` (default) or ``Sum``.
        process_set: The :class:`ProcessSet` to run on (default None: every rank).
        prescale_factor: Multiplies each tensor before the reduction (default 1.0).
        postscale_factor: Multiplies each reduced block (default 1.0).

    Returns:
        An int handle; :func:`synchronize` returns the tuple of this rank's blocks.

    Raises:
        ValueError: as :func:`grouped_reducescatter`.
        NotImplementedError: as :func:`grouped_reducescatter`.
        TypeError: as :func:`grouped_reducescatter`.
    """
    tensors = _check_list("grouped_reducescatter_async", tensors, name)
    op = _check_scatter("grouped_reducescatter_async", tensors[0], name, None, op,
                        prescale_factor, postscale_factor)
    return _queued("grouped_reducescatter_async", name, process_set, lambda: tuple(
        reducescatter_many(tensors, op, prescale_factor, postscale_factor, name,
                           "grouped_reducescatter_async", process_set)))
