"""Horovod's ``sparse_allreduce_async``: the reduction of a torch sparse COO tensor, done as Horovod
does it, by gathering every rank's indices and values (here in one allgather message) into an
uncoalesced sparse tensor whose duplicate entries add up (divided by the number of ranks for
``Average``).

Horovod returns a function to call for the result; hvd_slim returns a :class:`SparseHandle`,
an int handle that is also callable, so both ``handle()`` and ``hvd.synchronize(handle)`` give
the result (once: the handle is released).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .async_ops import _handle, synchronize
from .checks import agree, label
from .fused import allgather_many
from .ops import Average, Sum, on_group

__all__ = ["sparse_allreduce_async", "SparseHandle"]


class SparseHandle(int):
    """The handle of :func:`sparse_allreduce_async`: an int for :func:`synchronize` and
    :func:`poll`, callable (no arguments) like the function Horovod returns."""

    def __call__(self) -> Optional[torch.Tensor]:
        return synchronize(self)


def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str], op: int,
                           process_set: Any = None) -> SparseHandle:
    """Sum or average a sparse COO tensor over all ranks by gathering indices and values.

    Collective: every rank passes a sparse tensor of the same dtype, size and sparse
    dimensions (else the same :class:`MismatchError` on every rank); the numbers of nonzeros
    may differ. It runs before this returns; not differentiable.

    Args:
        tensor: This rank's ``torch.sparse_coo`` tensor (coalesced or not).
        name: A str naming the tensor in error messages, or None (Horovod requires it
            positionally; hvd_slim accepts None).
        op: ``Average`` (the values are divided by the number of ranks; integers truncate
            toward zero) or ``Sum``.
        process_set: The :class:`ProcessSet` to run on (default None: every rank).

    Returns:
        A :class:`SparseHandle`: call it, or pass it to :func:`synchronize`, for the
        uncoalesced sparse result of the input's size, dtype and device, whose entries are
        every rank's (duplicates add up when coalesced or densified).

    Raises:
        TypeError: ``tensor`` is not a sparse COO tensor, or ``name`` is not a str or None.
        ValueError: ``op`` is not ``Average`` or ``Sum``, or the ranks' tensors differ (a
            :class:`MismatchError`, also a RuntimeError).
        TransportTimeout: a rank did not arrive within ``HVD_SLIM_TIMEOUT`` seconds.
    """
    what = "sparse_allreduce_async"
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        got = tensor.layout if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise TypeError(f"{what}: tensor must be a torch sparse COO tensor, got {got}; for a dense "
                        f"tensor use hvd.allreduce_async")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{what}: name must be a str or None, got {type(name).__name__}")
    if op not in (Average, Sum) or isinstance(op, bool):
        raise ValueError(f"{what}: op={op!r} is not hvd.Average or hvd.Sum")
    with on_group(f"{what}{label(name)}", process_set) as (api, group):
        shape = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        agree(api, what, name, shape, {"sparse_dim": tensor.sparse_dim()})
        size = group.size
    indices = tensor._indices().t().contiguous()   # (nnz, sparse_dim): gathered along nnz
    values = tensor._values().contiguous()
    indices, values = allgather_many([indices, values], name, what, process_set)
    if op == Average:
        values = values / size if values.is_floating_point() or values.is_complex() else \
            values.div(size, rounding_mode="trunc")
    # The indices come from other ranks: check them against the agreed size.
    result = torch.sparse_coo_tensor(indices.t(), values, tensor.shape, dtype=tensor.dtype,
                                     device=tensor.device, check_invariants=True)
    return SparseHandle(_handle(result))
