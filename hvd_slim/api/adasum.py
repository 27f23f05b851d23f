"""Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation"), the reduction
behind ``op=hvd.Adasum`` of :func:`~hvd_slim.allreduce` and :func:`~hvd_slim.grouped_allreduce`.

Two vectors ``a`` and ``b`` combine into ``(1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b``;
a coefficient stays 1 when its vector's squared norm is below ``sqrt(DBL_MIN)``, as in Horovod.
Ranks combine pairwise in a tree of distance doubling: at level ``l`` (1, 2, 4, ...) rank ``r``
combines with rank ``r ^ l``, the one whose bit ``l`` is clear supplying ``a``. This is the
order of Horovod's vector-halving, distance-doubling Adasum over MPI; hvd_slim swaps whole
vectors at each level instead of halves (the same result, ``log2(size)`` full-size messages), so
both ranks of a pair compute the same combination from the same operands and every rank ends
with the same bits. Dot products and norms are accumulated in float64, each tensor of a group
separately; the combination is computed in float64 and stored in the tensor's dtype (float16
and bfloat16 are staged in float32).

As in Horovod, the number of ranks must be a power of two (NotImplementedError otherwise) and
only floating point tensors can be combined. Unlike Horovod, a process set (of a power-of-two
size) is accepted: the tree runs on its ranks.
"""
from __future__ import annotations

import sys
from typing import Any, List, Sequence, Tuple

import torch

_TINY = sys.float_info.min ** 0.5   # Horovod's sqrt(DBL_MIN): a smaller norm keeps coefficient 1
FLOATS = (torch.float32, torch.float64)


def check_size(what: str, size: int) -> None:
    """Horovod's refusal of a world (or set) whose size is not a power of two."""
    if size < 1 or size & (size - 1):
        raise NotImplementedError(f"{what}: running Adasum with non-power of 2 ranks is not "
                                  f"supported (as in Horovod); this group has {size} ranks")


def coefficients(dot: float, anormsq: float, bnormsq: float) -> Tuple[float, float]:
    """The weights of ``a`` and ``b`` in their Adasum combination."""
    acoeff = 1.0 - dot / anormsq * 0.5 if anormsq >= _TINY else 1.0
    bcoeff = 1.0 - dot / bnormsq * 0.5 if bnormsq >= _TINY else 1.0
    return acoeff, bcoeff


def combine(a: torch.Tensor, b: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Adasum of two flat tensors of one dtype, segment by segment (``counts`` elements each:
    a group's tensors, each with its own dot product and norms)."""
    out = torch.empty_like(a)
    start = 0
    for n in counts:
        x = a[start:start + n].to(torch.float64, copy=True)   # never scale the caller's tensor
        y = b[start:start + n].double()
        ac, bc = coefficients(float(x.dot(y)), float(x.dot(x)), float(y.dot(y)))
        out[start:start + n] = x.mul_(ac).add_(y, alpha=bc)
        start += n
    return out


def reference(vectors: Sequence[torch.Tensor], counts: Sequence[int] = ()) -> torch.Tensor:
    """The Adasum of every rank's flat tensor (``vectors[r]`` being rank ``r``'s) in one process,
    by the same pairwise tree as :func:`adasum_`: a reference for tests."""
    level: List[torch.Tensor] = [v.reshape(-1) for v in vectors]
    check_size("adasum reference", len(level))
    counts = list(counts) or [level[0].numel()]
    while len(level) > 1:
        level = [combine(level[i], level[i + 1], counts) for i in range(0, len(level), 2)]
    return level[0].clone()


def adasum_(api: Any, rank: int, size: int, buf: torch.Tensor, counts: Sequence[int]) -> None:
    """Replace the flat contiguous CPU tensor ``buf`` (float32 or float64) with the Adasum of
    every rank's, over ``api`` (the group's :class:`MpiCollectives`; ``rank`` and ``size`` are
    this rank's position in the group and its size, a power of two). Collective."""
    other = torch.empty_like(buf)
    mine = buf.view(torch.uint8).numpy()
    theirs = other.view(torch.uint8).numpy()
    level = 1
    while level < size:
        api.sendrecv_bytes(mine, theirs, rank ^ level)
        a, b = (buf, other) if rank & level == 0 else (other, buf)
        buf.copy_(combine(a, b, counts))
        level <<= 1
