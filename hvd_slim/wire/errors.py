"""The one exception every strict decoder in :mod:`hvd_slim.wire` raises."""
from __future__ import annotations


class WireError(ValueError):
    """A malformed or mismatched payload; the message says what was expected and what came."""
