"""The scores as :class:`~hvd_slim.selection.core.CoreSelector` reads them, in numpy (CPU
tensors): the :class:`~hvd_slim.selection.backend.Scores` contract, and the reference its
torch twin (scores_torch.py) matches bitwise."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np
import torch

from .scores_torch import _as_float

# Elements per block of the significance and candidate loops: a 1 MiB float32 scratch stays in L2 cache, and
# blocks this size keep Python overhead under a millisecond for 10M+ elements.
_BLOCK = 1 << 18
# order_stats partitions only the low end of at least this many candidates, bounded from a
# sample of about this many.
_SPLIT_MIN, _SPLIT_SAMPLE = 1 << 15, 1 << 12


def _as_numpy(score: torch.Tensor) -> np.ndarray:
    """A 1-D float32/float64 numpy view of ``score`` (a copy only for other devices/dtypes)."""
    t = _as_float(score)
    if t.device.type != "cpu":
        t = t.cpu()   # only when the numpy path is forced on another device's tensor
    return t.contiguous().numpy()


class NumpyScores:
    """The scores as :class:`CoreSelector` reads them, in numpy: ``s`` itself, or ``|s|``
    computed only where it is looked at (``magnitude``), so no full-size score buffer is
    written. :class:`~hvd_slim.selection.scores_torch.TorchScores` is the same in torch ops."""

    def __init__(self, s: np.ndarray, magnitude: bool) -> None:
        self.s, self.magnitude, self.n = s, magnitude, s.size
        self.sample = np.empty(0, dtype=s.dtype)
        self.m = 0

    def _scored(self, x: np.ndarray) -> np.ndarray:
        """What the scores ``x`` (a part of ``s``) stand for: ``|x|`` with ``magnitude``."""
        return np.abs(x) if self.magnitude else x

    def take_sample(self, stride: int) -> None:
        x = self.s[stride // 2::stride]
        self.sample = self._scored(x)
        self.m = self.sample.size

    def sample_count_ge(self, thr: float) -> int:
        return int(np.count_nonzero(self.sample >= thr))

    def sample_order(self, i: int) -> float:
        """The ``i``-th smallest sample value (0-based)."""
        x = self.sample
        zero = x == 0
        zeros = int(np.count_nonzero(zero))
        if 4 * zeros < x.size:
            return float(np.partition(x, i)[i])
        # np.partition slows tenfold when most values are one value (6 ms instead of 0.5 on
        # 65k samples): a server's residual is zero wherever no push landed. The zeros are
        # counted instead, and the rest split on either side of them.
        below = x[x < 0]
        if i < below.size:
            return float(np.partition(below, i)[i])
        i -= below.size
        if i < zeros:
            return 0.0
        above = x[x > 0]
        return float(np.partition(above, i - zeros)[i - zeros])

    def sample_max_below(self, thr: float) -> Optional[float]:
        below = self.sample[self.sample < thr]
        return float(below.max()) if below.size else None

    def at_least(self, thr: float) -> Tuple[np.ndarray, np.ndarray]:
        """Ascending indices with score >= ``thr``, and their scores."""
        return self._scan(np.greater_equal, thr)

    def positives(self) -> Tuple[np.ndarray, np.ndarray]:
        """Ascending indices with score > 0, and their scores: NaN stays out (``|NaN| > 0`` is
        False)."""
        return self._scan(np.greater, 0.0)

    def _scan(self, op: Any, thr: float) -> Tuple[np.ndarray, np.ndarray]:
        """Ascending indices where ``op(score, thr)`` and the scores there, block by block: the
        block's scores and mask stay in cache instead of full-size temporaries going through
        memory, and the hits' scores are read from the block while it is there (a gather from
        the whole array afterwards cost 2.5 ms a step on ResNet-18's 11.7M coordinates)."""
        s, n, idx, vals = self.s, self.n, [], []
        scratch = np.empty(min(n, _BLOCK), dtype=s.dtype) if self.magnitude else None
        for lo in range(0, n, _BLOCK):
            blk = s[lo:lo + _BLOCK]
            if scratch is not None:
                blk = np.abs(blk, out=scratch[:blk.size])
            hits = _flat_hits(op(blk, thr))
            if hits.size:
                vals.append(blk[hits])
                idx.append(hits + lo)
        if not idx:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=s.dtype)
        return np.concatenate(idx), np.concatenate(vals)

    @staticmethod
    def order_stats(vals: np.ndarray, j: int, jw: Optional[int]) -> Tuple[Any, Optional[float]]:
        """(the ``j``-th smallest of ``vals``, the ``jw``-th smallest or None); ``jw < j``.

        ``j`` is usually the candidates' margin, a tenth of them: a bound from a strided
        sample keeps the smallest values, and only they are partitioned (2.3x faster on 2M
        candidates, a warm-up's). With more than ``j`` values at or below the bound, the ``j``
        smallest of ``vals`` are all among them, so the order statistics are the same values."""
        n = vals.size
        if n >= _SPLIT_MIN and 4 * j < n:
            stride = max(1, n // _SPLIT_SAMPLE)
            sample = vals[stride // 2::stride]
            r = min(sample.size - 1, int(1.25 * j * sample.size / n) + 16)
            low = vals[vals <= np.partition(sample, r)[r]]
            if low.size > j:
                vals = low
        part = np.partition(vals, j)
        # The jw-th smallest lies among the j values the partition already split off below.
        nxt = None if jw is None else float(np.partition(part[:j], jw)[jw])
        return part[j], nxt

    @staticmethod
    def above(cand: np.ndarray, vals: np.ndarray, thr: float) -> Tuple[np.ndarray, np.ndarray]:
        keep = vals > thr
        return cand[keep], vals[keep]

    @staticmethod
    def count_above(vals: np.ndarray, thr: float) -> int:
        return int(np.count_nonzero(vals > thr))

    @staticmethod
    def keep_top(cand: np.ndarray, vals: np.ndarray, kth: Any, k: int, ties: int = 0
                 ) -> np.ndarray:
        keep = vals > kth
        need = k - int(np.count_nonzero(keep))
        tied = np.flatnonzero(vals == kth)
        start = ties % tied.size if need < tied.size else 0
        keep[tied[start:start + need]] = True   # a run of the tied, from ``start``...
        keep[tied[:max(0, start + need - tied.size)]] = True   # ...wrapping around
        return cand[keep]

    def any_negative(self) -> bool:
        return False if self.magnitude else bool(np.any(self.s < 0))

    def with_lowest_zeros(self, cand: np.ndarray, need: int) -> np.ndarray:
        """The positive entries ``cand`` plus the ``need`` lowest-indexed others, ascending."""
        m = min(self.n, need + cand.size)
        head = self._scored(self.s[:m]) > 0
        head[np.flatnonzero(~head)[:need]] = True
        return np.concatenate([np.flatnonzero(head), cand[np.searchsorted(cand, m):]])

    @staticmethod
    def result(idx: np.ndarray, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(idx).to(device)


def _flat_hits(mask: np.ndarray) -> np.ndarray:
    """``np.flatnonzero(mask)`` for a sparse boolean mask in about half the time: the mask is
    packed 8 to a byte, and only the non-zero bytes are unpacked and searched (numpy's nonzero
    costs about 0.5 ns an element; a few percent of hits leave most bytes zero)."""
    packed = np.packbits(mask)
    nz = np.flatnonzero(packed != 0)
    # unpackbits gives 0/1 bytes: read as bool, nonzero takes its fast path (uint8's is 6x slower)
    bits = np.flatnonzero(np.unpackbits(packed[nz]).view(bool))
    return (nz[bits >> 3] << 3) | (bits & 7)
