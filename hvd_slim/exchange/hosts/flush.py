"""The flush of ``hierarchical=True`` (exchange/hosts/hierarchy.py): every residual of every host,
and every rank's carry, sent densely into the compressed ``p.grad`` (dense-bucket grads are
untouched), so that after ``optimizer.flush()`` nothing computed is pending.

1. Every rank's carry goes into its host's residual pieces first, as a step that failed after
   its host reduction would keep it: every rank host-reduces its carry alone (every rank, with
   a carry or not, so the collectives agree), and the pieces absorb the host's sum of them.
2. Each rank's cross exchange flushes its pieces' residuals (the host's and the server's).
3. The flushed pieces, or the verdict, are spread on the host, as a step's are.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import NonFiniteGradientError
from .wire import FAILED, NONFINITE, OK

if TYPE_CHECKING:   # pragma: no cover
    from .hierarchy import HierarchicalExchange


def flush(ex: "HierarchicalExchange") -> None:
    """:meth:`HierarchicalExchange.flush`, on the caller's side of ``exclusive``."""
    t = ex.step_count
    ex.agreement.ensure(ex, t, ex.collective)
    flush_carry(ex, t)
    for _, p in ex.pieces.values():
        p.grad = None   # the flush fills the compressed pieces only
    status, error = OK, None
    try:
        if ex.inner is not None:
            ex.inner.flush()
    except NonFiniteGradientError as exc:
        status, error = NONFINITE, exc
    except Exception as exc:  # noqa: BLE001 - the host must learn of it, then it is raised
        status, error = FAILED, exc
    mine = [ex.pieces[i][1] for i in ex.host_phases.frames.pieces_of(ex.local_rank)]
    read = ex.host_phases.spread(t, status, error, [
        torch.zeros_like(p) if p.grad is None else p.grad for p in mine])
    if read is not None:
        if ex.inner is None:
            ex.stats.flushes += 1   # as a cross exchange counts its own
        ex.host_phases.write(read, only_sparse=True)


def flush_carry(ex: "HierarchicalExchange", t: int) -> None:
    """Step 1: every rank's carry into its host's residual pieces. The pieces absorb only
    when a rank of the host had a carry (a flag every rank of the host reads alike), since
    absorbing nothing would still move a momentum-corrected residual. A failed reduction keeps
    the carry where it is."""
    host = ex.host_phases
    carried = host.reduce(t, ex.pieces, host.encode_carry())
    if carried and ex.inner is not None:
        ex.inner.absorb(None)
    host.taken()
