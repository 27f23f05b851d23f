"""Core selection (docs/design.md §2, "Select"): the ``k`` most significant coordinates, cheaply.

``torch.topk`` over millions of coordinates costs a partial sort every step (about 200 ms for
11.7M floats on one CPU thread). :class:`CoreSelector` gets the same exact top-k *set* from
about one vectorised threshold pass:

1. Pick a threshold that ``k`` plus a small margin of entries should reach: the one carried
   over from the previous call when a strided sample says it still fits, else an order
   statistic of that sample.
2. One pass collects the candidates ``score >= threshold``; too few and the threshold is
   lowered from the sample (a few times at most, then down to zero, which always suffices).
3. An exact selection among the candidates only (``np.partition``, linear time) gives exactly
   ``k``; ties at the k-th value are taken in index order from a given start (``ties``; 0,
   the default, takes the lowest indices), so results are deterministic.

The steps read the scores only through the :class:`~hvd_slim.selection.backend.Scores`
contract: CPU scores run in numpy (scores_numpy.py), scores on a GPU the same steps in torch
ops on the GPU (scores_torch.py; selection/backend.py decides), with bitwise the same result
and threshold.

The threshold for the next call is the candidate value at rank ``k + margin``, a plain Python
float in :meth:`CoreSelector.state_dict`, so a restored run selects bitwise identically.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from .backend import A, Scores, use_torch
from .scores_numpy import _BLOCK, NumpyScores, _as_numpy
from .scores_torch import TorchScores, _as_float


def significance(a: torch.Tensor, w: Optional[torch.Tensor], lam: float,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Return ``|a| + lam * |w|`` for 1-D float tensors, written into ``out`` when given.

    ``w`` is ignored when ``lam == 0`` or ``w is None``. ``out`` may alias ``a`` or ``w``.
    """
    if a.dim() != 1:
        raise ValueError(f"significance: a must be 1-D, got shape {tuple(a.shape)}")
    if lam < 0 or not math.isfinite(lam):
        raise ValueError(f"significance: lam must be finite and >= 0, got {lam}")
    use_w = w is not None and lam != 0
    if use_w and w.shape != a.shape:
        raise ValueError(f"significance: w has shape {tuple(w.shape)}, expected {tuple(a.shape)}")
    if out is None:
        out = torch.empty_like(a)
    elif out.shape != a.shape or out.dtype != a.dtype:
        raise ValueError(f"significance: out is {tuple(out.shape)} {out.dtype}, "
                         f"expected {tuple(a.shape)} {a.dtype}")
    if not use_w:
        return torch.abs(a, out=out)
    # Blockwise with a cache-sized scratch: no full-size temporary, and each block of ``out``
    # is written once while still in cache (about 4x faster than ``out.add_(w.abs())``).
    n = a.numel()
    scratch = torch.empty(min(n, _BLOCK), dtype=a.dtype, device=a.device)
    for lo in range(0, n, _BLOCK):
        hi = min(n, lo + _BLOCK)
        o, s = out[lo:hi], scratch[: hi - lo]
        torch.abs(w[lo:hi], out=s)   # w first: out may alias a, never both a and w
        torch.abs(a[lo:hi], out=o)
        o.add_(s, alpha=lam)
    return out


class CoreSelector:
    """Exact top-k index sets by a carried threshold: about one pass over the scores per call.

    ``margin``: fraction of extra candidates aimed for (cheap to sort out, and it absorbs drift
    between calls). ``sample_size``: about how many strided samples estimate a fresh threshold.
    """

    def __init__(self, margin: float = 0.1, sample_size: int = 1 << 16,
                 backend: Optional[str] = None) -> None:
        if margin <= 0 or sample_size < 1:
            raise ValueError(f"CoreSelector: need margin > 0 and sample_size >= 1, "
                             f"got {margin} and {sample_size}")
        if backend not in (None, "numpy", "torch"):
            raise ValueError(f"CoreSelector: backend must be None, 'numpy' or 'torch', "
                             f"got {backend!r}")
        # None: numpy for CPU tensors (faster there), torch ops on any other device (the scores
        # never leave it); see selection/backend.py. The choice never changes the result.
        self.backend = backend
        self.margin = float(margin)
        self.sample_size = int(sample_size)
        self._thr: Optional[float] = None
        # Diagnostics of the last call (not state): candidate passes made and candidates kept.
        self.last_passes = 0
        self.last_candidates = 0

    # ----------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """The carried threshold (a Python float, or None before the first call)."""
        return {"threshold": self._thr}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        thr = state.get("threshold")
        if thr is not None:
            thr = float(thr)
            if not math.isfinite(thr):
                raise ValueError(f"CoreSelector: threshold must be finite, got {thr}")
        self._thr = thr

    # ----------------------------------------------------------------------------- select
    def select(self, score: torch.Tensor, k: int, ties: int = 0, short: bool = False,
               nonfinite_first: bool = False) -> torch.Tensor:
        """Indices (int64, ascending, unique) of exactly ``min(k, numel)`` top entries of ``score``.

        ``score`` is 1-D, non-negative and NaN-free. Of the entries tied at the k-th value, as
        many as fit are taken in index order, starting with the ``ties mod count``-th and
        wrapping around (0: the lowest indices); zeros filling up a short set always go by
        lowest index. With ``short``, a set short of positive entries is returned as it is,
        fewer than k (every positive entry), instead of filled up with zeros. With
        ``nonfinite_first``, NaN and +/-Inf entries are allowed and rank above every finite
        one (``nonfinite="propagate"``: they travel at once, as in a dense allreduce, instead
        of a NaN, which no comparison chooses, waiting in a residual for a flush); it costs
        one more pass over ``score``.
        """
        return self._run(score, k, magnitude=False, ties=ties, short=short,
                         nonfinite_first=nonfinite_first)

    def select_magnitude(self, a: torch.Tensor, k: int, ties: int = 0, short: bool = False,
                         nonfinite_first: bool = False) -> torch.Tensor:
        """As :meth:`select` on ``|a|``, without materialising ``|a|``: the candidate pass takes
        absolute values block by block in cache (one read of ``a`` instead of a full-size
        write and re-read). ``a`` is 1-D and NaN-free (unless ``nonfinite_first``); the result
        is bitwise that of ``select(a.abs(), k, ties, short, nonfinite_first)``."""
        return self._run(a, k, magnitude=True, ties=ties, short=short,
                         nonfinite_first=nonfinite_first)

    def _run(self, score: torch.Tensor, k: int, magnitude: bool, ties: int = 0,
             short: bool = False, nonfinite_first: bool = False) -> torch.Tensor:
        k = int(k)
        if k < 0:
            raise ValueError(f"select: k must be >= 0, got {k}")
        if nonfinite_first:
            bad = ~torch.isfinite(score)
            if bool(bad.any()):
                # Scored as the dtype's largest finite value: chosen first, and the carried
                # threshold stays finite (a checkpoint refuses an infinite one).
                score = (score.abs() if magnitude else score.clone()).masked_fill_(
                    bad, torch.finfo(score.dtype).max)
                magnitude = False
        torch_path = self.backend == "torch" or (self.backend is None and use_torch(score))
        s: Scores[Any] = TorchScores(_as_float(score), magnitude) if torch_path \
            else NumpyScores(_as_numpy(score), magnitude)
        if k == 0 or k >= s.n:
            return torch.arange(min(k, s.n), dtype=torch.int64, device=score.device)
        return s.result(self._select(s, k, int(ties), short), score.device)

    def _select(self, s: Scores[A], k: int, ties: int = 0, short: bool = False) -> A:
        n = s.n
        want = k + max(16, math.ceil(self.margin * k))   # aimed-for candidate count
        s.take_sample(max(1, n // self.sample_size))     # strided, deterministic

        thr = self._thr
        if thr is not None:
            # Check the carried threshold on the sample first (0.1 ms): drift inside the band is
            # absorbed by the margin; outside it (e.g. the scale jumped), a fresh estimate costs
            # a sample partition (well under a millisecond) instead of a wasted or bloated pass.
            est = s.sample_count_ge(thr) * (n / s.m)
            if not (k + want) / 2 <= est <= 1.3 * want:
                thr = None
        if thr is None:
            thr = self._estimate(s, want)

        passes, cand, vals = 0, None, None
        for mult in (4.0, 16.0, 0.0):
            if thr <= 0:
                break
            cand, vals = s.at_least(thr)
            passes += 1
            if len(cand) >= k:
                break
            cand = None
            if not mult:
                break
            # Too few: lower the threshold, strictly, from wider sample ranks.
            lower = self._estimate(s, want * mult)
            if lower >= thr:
                below = s.sample_max_below(thr)
                lower = 0.0 if below is None else below
            thr = lower
        self.last_passes = passes
        if cand is None:
            # Still too few after three passes (or a zero threshold): zero always suffices.
            self.last_passes += 1
            return self._select_from_zero(s, k, want, short)
        self.last_candidates = len(cand)
        return self._exact(s, cand, vals, k, want, floor=thr, ties=ties)

    def _estimate(self, s: Scores[Any], want: float) -> float:
        """A threshold that about ``want`` of ``n`` entries reach, from the sample (0.0: all)."""
        m = s.m
        expect = m * want / s.n
        # Aim a few standard deviations of sampling noise high so one pass usually suffices.
        r = math.ceil(expect + 3.0 * math.sqrt(expect)) + 1
        if r >= m:
            return 0.0
        return s.sample_order(m - r)

    def _exact(self, s: Scores[A], cand: A, vals: A, k: int, want: int,
               floor: Optional[float] = None, ties: int = 0) -> A:
        """Exactly ``k`` of ``cand`` (ascending indices, with their scores ``vals``), and the
        threshold for the next call (the ``want``-th largest candidate, else one estimated
        afresh). ``floor``: a value every candidate reaches, when there is one.

        Candidates can tie at the floor by the tens of thousands: a server's residual sums a
        few float8 pushes, so its values sit on a coarse grid (on the benchmark's 1.1M
        parameters at 4 ranks, 27-51k of 42-75k candidates shared the floor). Where the k-th
        value is the floor itself, the tied ones are taken by index with no partition; where
        it lies above, they are dropped before the partition. Results and carried threshold
        are those of the plain partition over every candidate."""
        c = len(cand)
        if c == k:
            self._thr = self._estimate(s, want)   # c < want: start lower next time
            return cand
        at_floor_nxt = None   # the next threshold, when the want-th candidate is the floor
        if floor is not None:
            above = s.count_above(vals, floor)
            if above < k:   # the k-th is the floor; so is the want-th when there is one
                self._thr = floor if c >= want else self._estimate(s, want)
                return s.keep_top(cand, vals, floor, k, ties)
            # Many candidates tie at the floor, below the k-th: np.partition slows several-fold
            # over many equal values (a 4-rank server's 569k candidates, 109k at the floor:
            # 24.7 ms, against 6.0 with them dropped first), so a sixteenth is enough to drop.
            if 16 * (c - above) >= c:
                if above < want <= c:
                    at_floor_nxt = floor
                cand, vals = s.above(cand, vals, floor)
                c = above
        # kth: the k-th largest value (ascending position c - k). With c >= want, the next
        # threshold is the want-th largest (ascending position c - want, below the k-th);
        # otherwise the next call starts lower, from the sample.
        kth, nxt = s.order_stats(vals, c - k, c - want if c >= want else None)
        if nxt is None:
            nxt = at_floor_nxt if at_floor_nxt is not None else self._estimate(s, want)
        self._thr = nxt
        return s.keep_top(cand, vals, kth, k, ties)   # ties at kth: a run from ``ties``

    def _select_from_zero(self, s: Scores[A], k: int, want: int, short: bool = False) -> A:
        """Threshold zero: every positive entry is a candidate; zeros fill up by lowest index
        (with ``short``, the positive entries alone)."""
        cand, vals = s.positives()
        if len(cand) >= k:
            self.last_candidates = len(cand)
            return self._exact(s, cand, vals, k, want)
        if s.any_negative():
            raise ValueError("select: score must be non-negative")
        self._thr = 0.0
        self.last_candidates = s.n
        if short:
            return cand
        return s.with_lowest_zeros(cand, k - len(cand))
