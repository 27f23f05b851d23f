"""Optimizer updates still in flight (``overlap_forward=True``) that a read of the parameters
must wait for: the tensor API's broadcasts and ``join``, and elastic commits, call
:func:`drain_all` before they read or send parameters.

The optimizer layer registers each object holding a deferred step here (optim/forward_apply.py),
so the tensor API needs nothing from that layer.
"""
from __future__ import annotations

import weakref
from typing import Protocol


class Drainable(Protocol):
    """Holds updates of a step in flight."""

    def drain(self) -> None:
        """Apply every update still in flight, waiting for its exchange."""


# Every holder of a step in flight (weakly: a dropped optimizer is no longer drained).
_live: "weakref.WeakSet[Drainable]" = weakref.WeakSet()


def track(holder: Drainable) -> None:
    """``holder`` has a step in flight: drain it before parameters are read."""
    _live.add(holder)


def untrack(holder: Drainable) -> None:
    """``holder`` has nothing in flight any more."""
    _live.discard(holder)


def drain_all() -> None:
    """Apply every optimizer's deferred updates (before parameters are read or sent)."""
    for holder in list(_live):
        holder.drain()
