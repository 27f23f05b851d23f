"""Top-k with error feedback (the DGC/GRACE family): the compressor that both top-k peers share,
the exchange benchmark's MPI allgather (peers.TopKAllgather) and the convergence study's
``--method topk`` (convergence/topk.py). They differ only in how the slices travel.

Each step a rank adds its gradient to its residual, sends the ``k = ceil(density * d)`` largest
magnitudes of the sum, and keeps the rest in the residual for later steps; the received slices
are averaged into a dense gradient.
"""
from __future__ import annotations

import math
import time
from typing import Optional, Sequence, Tuple

import torch


class TopKErrorFeedback:
    """A rank's residual over ``numel`` compressed coordinates and its top-k selection."""

    def __init__(self, numel: int, density: float) -> None:
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        self.k = min(numel, max(1, math.ceil(density * numel))) if numel else 0
        self.residual = torch.zeros(numel)
        self.select_seconds = 0.0   # in torch.topk alone: what the benchmark reports as selection

    def compress(self, grad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Add ``grad`` (flat) to the residual; return the int64 indices and the values of its
        ``k`` largest magnitudes, which leave the residual (error feedback keeps the rest)."""
        acc = self.residual.add_(grad)
        start = time.perf_counter()
        idx = torch.topk(acc.abs(), self.k, sorted=False).indices
        self.select_seconds += time.perf_counter() - start
        values = acc[idx].clone()
        acc[idx] = 0.0
        return idx, values


def average(indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor], numel: int, n: int,
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The dense average over ``n`` ranks of the slices ``(indices[j], values[j])`` (into
    ``out`` when given: it is zeroed first)."""
    total = torch.zeros(numel) if out is None else out.zero_()
    for idx, vals in zip(indices, values):
        total.index_add_(0, idx, vals)
    return total.div_(n)
