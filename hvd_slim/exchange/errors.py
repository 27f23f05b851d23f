"""Exceptions of the exchange: each is raised identically on every rank of the job."""
from __future__ import annotations


class ExchangeError(RuntimeError):
    """A step failed on the server or in decoding (a malformed message, ranks that disagree on
    the model or settings); raised identically on every rank."""


class NonFiniteGradientError(ExchangeError, FloatingPointError):
    """A gradient held NaN or Inf on some rank and ``nonfinite="raise"``: every rank raises this,
    naming the ranks and tensors, and no rank's parameters, residuals or optimizer state changed."""


# Appended to timeout errors: what usually causes one, and how to wait longer.
TIMEOUT_ADVICE = ("A rank died or hangs, or the ranks called optimizer.step() a different number "
                  "of times. If a rank legitimately keeps the others waiting this long (e.g. a "
                  "rank-0-only evaluation or checkpoint), raise HVD_SLIM_TIMEOUT (the timeout= "
                  "keyword; 0 waits forever)")
