"""Moving an hvd_slim ``DistributedOptimizer`` onto the communicator of a rebuilt hvd_slim.

The optimizer's exchange holds the MPI transport of the runtime it was built under, and its
state (residuals, the server's per-worker copies) is laid out for that job's rank and size.
After :mod:`hvd_slim.elastic.recovery` rebuilt hvd_slim on the survivors, the exchange is built
anew on the new transport, keeping the optimizer object, its layout and inner state. The optimizer
builds the new exchange itself (``_rebind_exchange``), so that everything holding the old one
moves with it; this module decides only what changes (the transport, and the settings the
survivors can no longer keep).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Optional

import torch

from ..runtime import basics


def is_slim_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is an hvd_slim ``DistributedOptimizer``."""
    return bool(getattr(optimizer, "_hvd_slim_wrapped", False))


def current_transport(optimizer: torch.optim.Optimizer) -> Any:
    """The transport the optimizer's exchange runs on."""
    return optimizer._exchange.transport   # type: ignore[attr-defined]


def rebind(optimizer: torch.optim.Optimizer) -> bool:
    """Rebuild the exchange of an hvd_slim optimizer on the runtime's current MPI transport.

    Returns False (nothing done) when it already runs there, or ``optimizer`` is not hvd_slim's.
    The new exchange starts empty (no residuals, step 0): the caller loads a committed state into
    it when that state's rank and size match. Only the MPI transport is rebuilt: a Gloo/NCCL
    exchange would need a new ``torch.distributed`` rendezvous, which this does not do.
    """
    if not is_slim_optimizer(optimizer):
        return False
    old = current_transport(optimizer)
    if old.name != "mpi":
        raise RuntimeError(f"hvd_slim.elastic: an optimizer on the {old.name!r} transport cannot "
                           "be moved to the survivors; elastic training needs transport='mpi'")
    new = basics.world_transport()
    if new is old:
        return False
    opt: Any = optimizer
    config = opt._settings.config
    if config.servers != "auto" and config.servers > new.size:
        # Fewer survivors than server shards: one shard per survivor (a state saved with
        # the old count is refused on load anyway, as its size differs).
        warnings.warn(f"hvd_slim.elastic: servers={config.servers} exceeds the {new.size} "
                      f"surviving ranks; the exchange continues with servers={new.size}")
        config = config.replaced(servers=new.size)
    if config.hierarchical:
        # The hosts lost a rank, so they no longer all hold as many: the survivors go flat.
        warnings.warn("hvd_slim.elastic: the exchange continues without hierarchical=True on "
                      "the surviving ranks")
        config = config.replaced(hierarchical=False)
    opt._rebind_exchange(dataclasses.replace(opt._settings, transport=new, config=config,
                                              ranks=None))
    return True


def exchange_fits(optimizer: torch.optim.Optimizer, saved: Optional[dict]) -> bool:
    """Whether the ``"hvd_slim"`` entry of a saved optimizer state (``saved``) belongs to this
    optimizer's exchange as it is now: the same rank of the same job size."""
    if not is_slim_optimizer(optimizer) or saved is None or "hvd_slim" not in saved:
        return False
    ex = optimizer._exchange   # type: ignore[attr-defined]
    entry = saved["hvd_slim"]
    return entry.get("rank") == ex.rank and entry.get("size") == ex.size
