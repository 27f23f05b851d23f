"""When each gradient is ready in a real backward pass: the input an overlapping peer's model
needs (Horovod starts a tensor's allreduce once every rank has produced it).

The ``floor`` job of a real-compute workload (:data:`benchmarks.models.REAL`) hooks every
parameter (``register_post_accumulate_grad_hook``) and records, per measured step, the seconds
from the step's start to each gradient's accumulation and to the end of ``backward()``. The
record keeps, per parameter, the median over steps of the slowest rank's time: a tensor is
fused only when all ranks have it, so the last rank's readiness is what counts.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Sequence, Tuple

import torch


class ReadyClock:
    """Hooks on ``named``'s parameters; :meth:`mark` after each measured step."""

    def __init__(self, named: Sequence[Tuple[str, torch.Tensor]]) -> None:
        self.names = [n for n, _ in named]
        self.numel = [int(p.numel()) for _, p in named]
        self._at = [0.0] * len(named)
        self.steps: List[Tuple[List[float], float]] = []   # (ready offsets, backward end)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i))
                         for i, (_, p) in enumerate(named)]

    def _hook(self, i: int) -> Any:
        def hook(_: torch.Tensor) -> None:
            self._at[i] = time.perf_counter()
        return hook

    def mark(self, t0: float, backward_end: float) -> None:
        """Keep this step's offsets from ``t0`` (the step's start)."""
        self.steps.append(([a - t0 for a in self._at], backward_end - t0))

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def profile(per_rank: Sequence[Sequence[Tuple[List[float], float]]], names: Sequence[str],
            numel: Sequence[int]) -> Dict[str, Any]:
    """The record's ``backward_profile`` from every rank's :attr:`ReadyClock.steps`: per
    parameter (in ``named_parameters`` order) the median over steps of the slowest rank's
    ready time, and the same of the end of ``backward()``."""
    steps = min(len(r) for r in per_rank)
    if steps == 0:
        return {}
    ready = [statistics.median(max(r[s][0][i] for r in per_rank) for s in range(steps))
             for i in range(len(names))]
    end = statistics.median(max(r[s][1] for r in per_rank) for s in range(steps))
    return {"names": list(names), "numel": list(numel), "ready_s": ready,
            "backward_end_s": end, "steps": steps, "ranks": len(per_rank)}
