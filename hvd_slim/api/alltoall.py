"""Horovod's ``alltoall`` and ``alltoall_async``: rank ``i`` sends its ``j``-th block of dim-0
rows to rank ``j`` and receives one block from every rank, in rank order, in one MPI
``Ialltoallv``.

``splits`` (a list, or an int32 or int64 tensor on any device, of one row count per rank of the
group) says how many rows go to each rank; without it dim 0 is split equally and must be
divisible by the number of ranks. As in Horovod the splits may sum to less than dim 0 (the
rows past their sum are not sent; their gradient is zero) but not to more. Bad splits on any
rank raise the same ValueError on every rank, after one small exchange of every rank's splits,
so no rank is left waiting and nothing is allocated from an unchecked count.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import numpy as np
import torch

from .async_ops import _queued
from .checks import agree, check_tensor_args, label
from .ops import _bytes, _differentiable, _direct, _host_copy, on_group

__all__ = ["alltoall", "alltoall_async"]

Splits = Union[None, torch.Tensor, list, tuple, np.ndarray]


def _local_splits(tensor: torch.Tensor, splits: Splits, size: int) -> Tuple[np.ndarray, str]:
    """This rank's send counts (``size`` int64s, zeros when bad) and what is wrong, if anything."""
    zeros = np.zeros(size, dtype=np.int64)
    if tensor.dim() == 0:
        return zeros, "the tensor is 0-d; pass a tensor with at least one dimension"
    rows = tensor.shape[0]
    if splits is None:
        if rows % size:
            return zeros, (f"splits=None splits dim 0 equally, but dim 0 ({rows}) is not divisible by "
                           f"the number of ranks ({size}); pass splits=")
        return np.full(size, rows // size, dtype=np.int64), ""
    if isinstance(splits, torch.Tensor):
        if splits.dtype not in (torch.int32, torch.int64) or splits.dim() != 1:
            return zeros, (f"splits must be a 1-D int32 or int64 tensor, got {splits.dtype} of shape "
                           f"{list(splits.shape)}")
        values = splits.detach().cpu().numpy().astype(np.int64)
    elif isinstance(splits, (list, tuple, np.ndarray)):
        items = list(np.asarray(splits).reshape(-1)) if isinstance(splits, np.ndarray) else list(splits)
        if any(isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) for v in items):
            return zeros, f"splits must hold ints, got {splits!r}"
        values = np.array(items, dtype=np.int64)
    else:
        return zeros, f"splits must be a list or an int32/int64 tensor, got {type(splits).__name__}"
    if values.size != size:
        return zeros, f"splits has {values.size} entries but the group has {size} ranks; pass one per rank"
    if (values < 0).any():
        return zeros, f"splits {values.tolist()} has negative entries"
    if int(values.sum()) > rows:
        return zeros, f"splits {values.tolist()} sum to {int(values.sum())}, more than dim 0 ({rows})"
    return values, ""


def alltoall_rows(tensor: torch.Tensor, splits: Splits, name: Optional[str], what: str,
                  process_set: Any = None) -> Tuple[torch.Tensor, np.ndarray]:
    """The exchange itself: the received rows (in rank order) and every rank's received count."""
    with on_group(f"{what}{label(name)}", process_set) as (api, group):
        size, me = group.size, group.rank
        mine, problem = _local_splits(tensor, splits, size)
        t = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
        agree(api, what, name, t, {}, dim0_free=True)
        table = api.allgather_int64([int(bool(problem)), *mine.tolist()])
        if table[:, 0].any():
            bad = [r for r in range(size) if table[r, 0]]
            raise ValueError(f"{what}{label(name)}: " + (problem if problem else
                             f"rank(s) {[group.ranks[r] for r in bad]} passed bad splits"))
        matrix = table[:, 1:]   # matrix[i, j]: rows rank i sends to rank j
        received = matrix[:, me].copy()
        host = t if _direct(t, t.dtype) else _host_copy(t)
        row_bytes = host.element_size() * int(np.prod(host.shape[1:], dtype=np.int64))
        sent = int(mine.sum())
        out = torch.empty((int(received.sum()), *t.shape[1:]), dtype=t.dtype)
        api.alltoallv_bytes(_bytes(host)[:sent * row_bytes], mine * row_bytes, _bytes(out),
                            received * row_bytes)
    return out.to(tensor.device), received


def _received_like(received: np.ndarray, splits: Splits) -> torch.Tensor:
    """Horovod's received splits: like ``splits`` when it is a tensor, else int32 on the CPU."""
    if isinstance(splits, torch.Tensor):
        return torch.from_numpy(received).to(device=splits.device, dtype=splits.dtype)
    return torch.from_numpy(received.astype(np.int32))


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Splits, name: Optional[str],
                process_set: Any) -> Any:
        out, received = alltoall_rows(tensor, splits, name, "alltoall", process_set)
        ctx.received, ctx.rows, ctx.name, ctx.ps = received, tensor.shape[0], name, process_set
        if splits is None:
            return out
        got = _received_like(received, splits)
        ctx.mark_non_differentiable(got)
        return out, got

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> Tuple[Optional[torch.Tensor], ...]:
        back, _ = alltoall_rows(grad.contiguous(), ctx.received, ctx.name, "alltoall (backward)", ctx.ps)
        if back.shape[0] < ctx.rows:   # rows past the splits' sum were not sent
            back = torch.cat([back, back.new_zeros((ctx.rows - back.shape[0], *back.shape[1:]))])
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Splits = None, name: Optional[str] = None,
             process_set: Any = None) -> Any:
    """Scatter blocks of ``tensor``'s dim 0 to every rank and gather the blocks sent to this one.

    Collective: every rank passes the same dtype and trailing dimensions (dim 0 may differ),
    else the same :class:`MismatchError` on every rank. Differentiable: the gradient goes
    back by an alltoall with the received splits (rows that were not sent get zeros).

    Args:
        tensor: This rank's dense tensor with at least one dimension.
        splits: Rows to send to each rank of the group, in rank order: a list of ints or a 1-D
            int32/int64 tensor (any device) with one non-negative entry per rank, summing to at
            most dim 0. None (default): dim 0 split equally, which must then be divisible by
            the number of ranks.
        name: Optional str naming the tensor in error messages.
        process_set: The :class:`ProcessSet` to run on (default None: every rank); ranks
            within it are positions in the set.

    Returns:
        Without ``splits``, the received rows (a new tensor of the input's dtype and device,
        concatenated in rank order). With ``splits``, a tuple of those rows and the received
        splits: rows received from each rank, like ``splits`` when it is a tensor (dtype and
        device), else an int32 CPU tensor, as in Horovod.

    Raises:
        ValueError: bad splits (on any rank: raised on every rank), a 0-d tensor, dim 0 not
            divisible without splits, or mismatched tensors (a :class:`MismatchError`, also a
            RuntimeError).
        TypeError: ``tensor`` is not a dense torch.Tensor, or ``name`` is not a str.
        TransportTimeout: a rank did not arrive within ``HVD_SLIM_TIMEOUT`` seconds.
    """
    check_tensor_args("alltoall", tensor, name)
    if _differentiable(tensor):
        return _AlltoallFn.apply(tensor, splits, name, process_set)
    out, received = alltoall_rows(tensor, splits, name, "alltoall", process_set)
    return out if splits is None else (out, _received_like(received, splits))


def alltoall_async(tensor: torch.Tensor, splits: Splits = None, name: Optional[str] = None,
                   process_set: Any = None) -> int:
    """:func:`alltoall` behind a handle; it runs collectively in the background, in its turn.

    Same checks and errors as :func:`alltoall`; not differentiable.

    Args:
        tensor: This rank's dense tensor with at least one dimension.
        splits: Rows to send to each rank, as in :func:`alltoall` (default None: equal).
        name: Optional str naming the tensor in error messages.
        process_set: The :class:`ProcessSet` to run on (default None: every rank).

    Returns:
        An int handle; :func:`synchronize` returns the tuple (received rows, received splits)
        whether or not ``splits`` was given, as Horovod's does.

    Raises:
        ValueError: as :func:`alltoall`.
        TypeError: ``tensor`` is not a dense torch.Tensor, or ``name`` is not a str.
    """
    check_tensor_args("alltoall_async", tensor, name)
    def body() -> Tuple[torch.Tensor, torch.Tensor]:
        out, received = alltoall_rows(tensor, splits, name, "alltoall_async", process_set)
        return out, _received_like(received, splits)
    return _queued("alltoall_async", name, process_set, body)
