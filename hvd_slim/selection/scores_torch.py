"""The scores as :class:`~hvd_slim.selection.core.CoreSelector` reads them, in torch ops on the
scores' own device: the :class:`~hvd_slim.selection.backend.Scores` contract with bitwise the
same results as :class:`~hvd_slim.selection.scores_numpy.NumpyScores`, and no host copy of
anything score- or index-sized (only scalars are read back).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch


def _as_float(score: torch.Tensor) -> torch.Tensor:
    """``score`` as a detached 1-D float32/float64 tensor on its device (other float dtypes
    become float32, as the numpy path does; the comparisons then agree bitwise)."""
    if score.dim() != 1:
        raise ValueError(f"select: score must be 1-D, got shape {tuple(score.shape)}")
    t = score.detach()
    if t.dtype not in (torch.float32, torch.float64):
        if not t.is_floating_point():
            raise ValueError(f"select: score must be a float tensor, got {score.dtype}")
        t = t.float()
    return t


class TorchScores:
    """:class:`~hvd_slim.selection.backend.Scores` in torch ops: ``s`` itself, or ``|s|``
    (``magnitude``), with the strided sample the threshold comes from. Thresholds are Python
    floats taken from the scores themselves, so comparing them in the scores' dtype is exact,
    as in numpy."""

    def __init__(self, s: torch.Tensor, magnitude: bool) -> None:
        self.s, self.magnitude, self.n = s, magnitude, s.numel()
        self.sample = s.new_empty(0)
        self.m = 0

    def _scored(self, x: torch.Tensor) -> torch.Tensor:
        """What the scores ``x`` (a part of ``s``) stand for: ``|x|`` with ``magnitude``."""
        return x.abs() if self.magnitude else x

    def take_sample(self, stride: int) -> None:
        x = self.s[stride // 2::stride]
        self.sample = x.abs() if self.magnitude else x.contiguous()
        self.m = self.sample.numel()

    def sample_count_ge(self, thr: float) -> int:
        return int((self.sample >= thr).sum())

    def sample_order(self, i: int) -> float:
        """The ``i``-th smallest sample value (0-based)."""
        # sort, not kthvalue: CUDA's kthvalue refuses torch.use_deterministic_algorithms(True),
        # and it made the whole selection 3.5x slower on an H200 (docs/gpu.md).
        return float(torch.sort(self.sample).values[i])

    def sample_max_below(self, thr: float) -> Optional[float]:
        below = self.sample[self.sample < thr]
        return float(below.max()) if below.numel() else None

    def at_least(self, thr: float) -> Tuple[torch.Tensor, torch.Tensor]:
        """Ascending indices with score >= ``thr`` (> 0), and their scores."""
        return self._hits(torch.ge, thr)

    def _hits(self, op: Any, thr: float) -> Tuple[torch.Tensor, torch.Tensor]:
        scored = self._scored(self.s)
        idx = op(scored, thr).nonzero().reshape(-1)
        return idx, scored.index_select(0, idx)

    @staticmethod
    def order_stats(vals: torch.Tensor, j: int, jw: Optional[int]
                    ) -> Tuple[torch.Tensor, Optional[float]]:
        """(the ``j``-th smallest of ``vals`` as a 0-d tensor on their device, the ``jw``-th
        smallest as a float or None)."""
        ordered = torch.sort(vals).values   # a few more than k values: cheap on a device
        kth = ordered[j]
        nxt = None if jw is None else float(ordered[jw])
        return kth, nxt

    @staticmethod
    def above(cand: torch.Tensor, vals: torch.Tensor, thr: float
              ) -> Tuple[torch.Tensor, torch.Tensor]:
        keep = vals > thr
        return cand[keep], vals[keep]

    @staticmethod
    def count_above(vals: torch.Tensor, thr: float) -> int:
        return int((vals > thr).sum())

    @staticmethod
    def keep_top(cand: torch.Tensor, vals: torch.Tensor, kth: Any, k: int, ties: int = 0
                 ) -> torch.Tensor:
        keep = vals > kth
        need = k - int(keep.sum())
        tied = (vals == kth).nonzero().reshape(-1)
        start = ties % tied.numel() if need < tied.numel() else 0
        keep[tied[start:start + need]] = True   # a run of the tied, from ``start``...
        keep[tied[:max(0, start + need - tied.numel())]] = True   # ...wrapping around
        return cand[keep]

    def positives(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Ascending indices with score > 0 (``|NaN| > 0`` is False: NaN stays out), and their
        scores."""
        return self._hits(torch.gt, 0.0)

    def any_negative(self) -> bool:
        return False if self.magnitude else bool((self.s < 0).any())

    def with_lowest_zeros(self, cand: torch.Tensor, need: int) -> torch.Tensor:
        """The positive entries ``cand`` plus the ``need`` lowest-indexed others, ascending."""
        m = min(self.n, need + cand.numel())
        head = self._scored(self.s[:m]) > 0
        head[(~head).nonzero().reshape(-1)[:need]] = True
        rest = cand[int(torch.searchsorted(cand, m)):] if cand.numel() else cand
        return torch.cat([head.nonzero().reshape(-1), rest])

    @staticmethod
    def result(idx: torch.Tensor, device: torch.device) -> torch.Tensor:
        return idx.to(device)
