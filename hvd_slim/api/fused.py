"""The fused collectives over a list of tensors behind the ``grouped_*`` API
(api/grouped.py): one cross-rank check for the whole list, then one MPI message per
dtype for a reduction (a flat buffer of every tensor of that dtype) and one message in all for
an allgather (bytes, any mix of dtypes), with the differentiable forms.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

from . import adasum
from .checks import agree_many, label
from .ops import _HALF, _MPI_OPS, _REDUCIBLE, Adasum, Average, _bytes, _host_copy, _scale_, on_group
from .process_sets import resolve


def _mixed_devices(tensors: Sequence[torch.Tensor]) -> int:
    return int(len({t.device for t in tensors}) > 1)


def allreduce_many(tensors: Sequence[torch.Tensor], op: int, prescale: float, postscale: float,
                   name: Optional[str], what: str, outs: Optional[Sequence[torch.Tensor]] = None,
                   process_set: Any = None) -> List[torch.Tensor]:
    """Reduce every tensor of ``tensors``: new tensors, or written into ``outs``."""
    with on_group(f"{what}{label(name)}", process_set) as (api, group):
        mixed = _mixed_devices(tensors)
        agree_many(api, what, name, tensors, {"op": op, "mixed_devices": mixed})
        if mixed:
            raise RuntimeError(f"{what}{label(name)}: the tensors are on different devices "
                               f"({sorted({str(t.device) for t in tensors})}); as in Horovod, a group "
                               f"must be on one device")
        for i, t in enumerate(tensors):
            work = torch.float32 if t.dtype in _HALF else t.dtype
            if work not in (adasum.FLOATS if op == Adasum else _REDUCIBLE):
                raise TypeError(f"{what}{label(name)}: cannot reduce dtype {t.dtype} (tensor {i}) "
                                f"with op={op}; use a floating point" +
                                ("" if op == Adasum else " or integer") + " tensor")
        if op == Adasum:
            adasum.check_size(what, group.size)
        results: List[torch.Tensor] = list(outs) if outs is not None else [None] * len(tensors)  # type: ignore
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            idx = [i for i, t in enumerate(tensors) if t.dtype == dtype]
            work = torch.float32 if dtype in _HALF else dtype
            counts = [tensors[i].numel() for i in idx]
            with torch.no_grad():
                flat = _host_copy(torch.cat([tensors[i].detach().reshape(-1) for i in idx]), work)
                _scale_(flat, prescale)
                if op == Adasum:
                    adasum.adasum_(api, group.rank, group.size, flat, counts)
                else:
                    api.allreduce_inplace(flat.numpy(), _MPI_OPS[op])
                _scale_(flat, postscale, group.size if op == Average else 1)
                start = 0
                for i, n in zip(idx, counts):
                    piece = flat[start:start + n].reshape(tensors[i].shape)
                    if outs is None:
                        results[i] = piece.to(tensors[i].device, dtype)
                    else:
                        outs[i].copy_(piece)
                    start += n
    return results


def allgather_many(tensors: Sequence[torch.Tensor], name: Optional[str], what: str,
                   process_set: Any = None) -> List[torch.Tensor]:
    """Allgather every tensor of ``tensors`` along dim 0 (0-d counts as one row) in one message."""
    flat = [t.detach().reshape(1) if t.dim() == 0 else t.detach() for t in tensors]
    with on_group(f"{what}{label(name)}", process_set) as (api, group):
        rows = agree_many(api, what, name, flat, {}, dim0_free=True)   # (ranks, tensors)
        row_bytes = np.array([t.element_size() * int(np.prod(t.shape[1:], dtype=np.int64))
                              for t in flat], dtype=np.int64)
        send = torch.cat([_host_copy(t).reshape(-1).view(torch.uint8) for t in flat])
        lengths = rows @ row_bytes
        out = torch.empty(int(lengths.sum()), dtype=torch.uint8)
        api.allgatherv_bytes(_bytes(send), lengths, out=_bytes(out))
        pieces: List[List[torch.Tensor]] = [[] for _ in flat]
        start = 0
        for r in range(group.size):
            for i in range(len(flat)):
                n = int(rows[r, i] * row_bytes[i])
                pieces[i].append(out[start:start + n])
                start += n
    results = []
    for t, src, part in zip(flat, tensors, pieces):
        joined = torch.cat(part) if part else torch.empty(0, dtype=torch.uint8)
        results.append(joined.view(t.dtype).reshape(-1, *t.shape[1:]).to(src.device))
    return results


class GroupedAllreduceFn(torch.autograd.Function):
    """Differentiable :func:`allreduce_many`: the gradients are reduced the same way."""

    @staticmethod
    def forward(ctx: Any, op: int, pre: float, post: float, name: Optional[str], process_set: Any,
                *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.args = (op, pre, post, name, process_set)
        return tuple(allreduce_many(tensors, op, pre, post, name, "grouped_allreduce",
                                    process_set=process_set))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        op, pre, post, name, ps = ctx.args
        back = allreduce_many([g.contiguous() for g in grads], op, pre, post, name,
                              "grouped_allreduce (backward)", process_set=ps)
        return (None, None, None, None, None, *back)


class GroupedAllgatherFn(torch.autograd.Function):
    """Differentiable :func:`allgather_many`: each rank gets its rows of the averaged gradient."""

    @staticmethod
    def forward(ctx: Any, name: Optional[str], process_set: Any,
                *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.name, ctx.ps, ctx.shapes = name, process_set, [t.shape for t in tensors]
        return tuple(allgather_many(tensors, name, "grouped_allgather", process_set))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        what = "grouped_allgather (backward)"
        reduced = allreduce_many([g.contiguous() for g in grads], Average, 1.0, 1.0, ctx.name, what,
                                 process_set=ctx.ps)
        rows = allgather_many([torch.tensor([s[0] if len(s) else 1]) for s in ctx.shapes], None, what,
                              ctx.ps)
        r = resolve(what, ctx.ps).rank
        mine = [g.narrow(0, int(n[:r].sum()), int(n[r])).reshape(s)
                for g, n, s in zip(reduced, rows, ctx.shapes)]
        return (None, None, *mine)
