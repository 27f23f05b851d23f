"""Polling a nonblocking operation against the deadline of :meth:`Transport.watch`.

Transport-neutral (no MPI here), so any transport whose operations can be tested for completion
(mpi4py requests, ``torch.distributed`` work handles) gets the same timeout behaviour and
messages.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable, Optional

from .base import TransportTimeout

# Polling yields the CPU between tests, as MPI's own blocking calls do on an oversubscribed node:
# measured at 3 ranks on 2 cores, a 4 MB gather + broadcast takes 20 ms polled with yields,
# 50 ms with a pure busy loop, 100 ms with 1 ms sleeps (MPI moves large messages in fragments
# only while someone polls). Only a wait already this long (a stalled peer, a rank-0-only
# evaluation) switches to sleeping, to stop burning a core.
IDLE_AFTER_S, IDLE_PAUSE_S = 5.0, 1e-3
_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
# Ranks that wait on the root wait this much longer (at most) than the root, so that when a peer
# hangs, the root, which can name it, times out first.
NON_ROOT_GRACE_S = 30.0
# Print one stall warning after waiting this long (or half the limit, if shorter).
STALL_WARNING_S = 60.0


def limit_for(seconds: Optional[float], root_side: bool) -> Optional[float]:
    """The wait limit of one operation: the deadline, plus a grace off the root."""
    if seconds is None:
        return None
    return seconds if root_side else seconds + min(0.5 * seconds, NON_ROOT_GRACE_S)


def poll_until(done: Callable[[], bool], *, rank: int, seconds: Optional[float], label: str,
               op: str, root_side: bool, stalled: Callable[[], str]) -> None:
    """Call ``done()`` until it returns True. Past the limit, raise :class:`TransportTimeout`:
    ``rank R: <op> in <label> timed out after S s: <stalled()>`` (``stalled`` says who is
    missing). ``seconds`` None waits forever (with one stall warning on stderr)."""
    if done():
        return
    limit = limit_for(seconds, root_side)
    warn_at = STALL_WARNING_S if limit is None else min(STALL_WARNING_S, 0.5 * limit)
    where = f" in {label}" if label else ""
    start = time.monotonic()
    while not done():
        waited = time.monotonic() - start
        if limit is not None and waited >= limit:
            raise TransportTimeout(f"rank {rank}: {op}{where} timed out after {limit:g} s: "
                                   f"{stalled()}")
        if warn_at is not None and waited >= warn_at:
            warn_at = None
            after = "it waits forever (timeout disabled)" if limit is None else \
                f"it gives up after {limit:g} s"
            sys.stderr.write(f"hvd_slim: rank {rank} has waited {waited:.0f} s in {op}{where}: "
                             f"{stalled()}; {after}\n")
            sys.stderr.flush()
        if waited < IDLE_AFTER_S:
            _yield()
        else:
            time.sleep(IDLE_PAUSE_S)
