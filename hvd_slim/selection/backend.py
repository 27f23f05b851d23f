"""Which implementation the selection code runs for a tensor, and the contract both meet.

numpy for CPU tensors (faster on a CPU, and a CPU tensor's numpy view is free), torch ops for
tensors on any other device (so a GPU's scores, cores and explored indices never go through
host memory). :class:`Scores` is what :class:`~hvd_slim.selection.core.CoreSelector` reads,
met by :class:`~hvd_slim.selection.scores_numpy.NumpyScores` and
:class:`~hvd_slim.selection.scores_torch.TorchScores`.

The two give bitwise the same results. ``FORCE_TORCH`` runs the torch code on CPU tensors too:
that is how the device path is tested on a machine without a GPU.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, Tuple, TypeVar, runtime_checkable

import torch

FORCE_TORCH = False

# The backend's array type: np.ndarray or torch.Tensor.
A = TypeVar("A")


def use_torch(t: torch.Tensor) -> bool:
    """Whether selection code should handle ``t`` with torch ops rather than numpy."""
    return FORCE_TORCH or t.device.type != "cpu"


@runtime_checkable   # so a test can check both backends against it
class Scores(Protocol[A]):
    """One call's scores as :class:`~hvd_slim.selection.core.CoreSelector` reads them: ``s``
    itself, or ``|s|`` (``magnitude``) computed only where looked at, with the strided sample a
    threshold is estimated from. Index arrays are int64 and ascending; thresholds are Python
    floats taken from the scores, so comparing them in the scores' dtype is exact."""

    s: A                # the 1-D float32/float64 scores (or values, with ``magnitude``)
    magnitude: bool     # read ``|s|`` rather than ``s``
    n: int              # len(s)
    sample: A           # the strided sample (``|s|`` there with ``magnitude``)
    m: int              # len(sample); 0 before take_sample

    def take_sample(self, stride: int) -> None:
        """Keep every ``stride``-th score, from ``stride // 2``, as the sample."""

    def sample_count_ge(self, thr: float) -> int:
        """How many sample values are >= ``thr``."""

    def sample_order(self, i: int) -> float:
        """The ``i``-th smallest sample value (0-based)."""

    def sample_max_below(self, thr: float) -> Optional[float]:
        """The largest sample value below ``thr``, or None when there is none."""

    def at_least(self, thr: float) -> Tuple[A, A]:
        """Ascending indices whose score is >= ``thr``, and the scores there."""

    def order_stats(self, vals: A, j: int, jw: Optional[int]) -> Tuple[Any, Optional[float]]:
        """(the ``j``-th smallest of ``vals``, in whatever form :meth:`keep_top` takes, and the
        ``jw``-th smallest as a float, or None when ``jw`` is None); ``jw < j``."""

    def count_above(self, vals: A, thr: float) -> int:
        """How many of ``vals`` exceed ``thr``."""

    def above(self, cand: A, vals: A, thr: float) -> Tuple[A, A]:
        """The entries of ``cand`` and ``vals`` where ``vals`` exceeds ``thr``, in order."""

    def keep_top(self, cand: A, vals: A, kth: Any, k: int, ties: int = 0) -> A:
        """The ``k`` entries of ``cand`` with the largest ``vals``: all above ``kth``, then
        as many of those equal to it as fit, in index order from the ``ties mod count``-th,
        wrapping around."""

    def positives(self) -> Tuple[A, A]:
        """Ascending indices of the scores > 0 (NaN stays out), and the scores there, in one
        pass."""

    def any_negative(self) -> bool:
        """Whether any score is < 0 (never, with ``magnitude``)."""

    def with_lowest_zeros(self, cand: A, need: int) -> A:
        """``cand`` (the positive entries, ascending) plus the ``need`` lowest-indexed others,
        ascending. Those others all lie below ``need + len(cand)``, so only that prefix of the
        scores is read, not all of it."""

    def result(self, idx: A, device: torch.device) -> torch.Tensor:
        """``idx`` as an int64 tensor on ``device``."""
