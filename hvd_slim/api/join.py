"""``hvd.join()`` and the ``DistributedOptimizer``: a rank that has run out of data keeps serving
the others' Slim-DP exchanges, and the replicas are equal again when the last rank joins.

Horovod's joined ranks feed zeros to every allreduce, the optimizer's included. hvd_slim's
exchange is not one allreduce but a push to the server and a pull back, on the optimizer's own
transport, so a joined rank has to know when the others start one. Hence a
``DistributedOptimizer`` on the whole job under hvd_slim's runtime starts every exchange and
flush with a header round on the job's communicator (:func:`~.runtime.engine.exchange_round`:
one allgather of a fixed-width row, as every tensor-API call has). A rank inside ``join`` reads
the optimizer's id from that round and runs the same exchange with no new gradient (its
residual is still pushed, so nothing it accumulated is lost; a server rank that joined goes on
aggregating), then the wrapped optimizer's step on the pulled update, as the others do.

That keeps parameters and optimizer state equal unless the others change the gradients between
``synchronize()`` and ``step()`` (clipping, a ``GradScaler``), which a joined rank cannot
repeat. So when the last rank joins, :func:`after_join` compares a digest of every served
optimizer's parameters and state across ranks and, where they differ, broadcasts both from
the last rank to join (it stepped every time). Horovod leaves a joined rank's model stale.
"""
from __future__ import annotations

import hashlib
from typing import Any, List, Optional

import torch

from ..runtime import basics
from . import engine
from .engine_rounds import JOIN, Sig
from .functions import allgather_object, broadcast_optimizer_state, broadcast_parameters
from .pending import drain_all

__all__ = ["join", "register", "after_join"]


def register(optimizer: Any, ranks: Optional[List[int]], transport: Any) -> Optional[int]:
    """The optimizer's join id, or None when a joined rank cannot serve its exchange: it runs
    inside a process set, or hvd_slim's runtime is not started (a transport passed in, Horovod's
    own runtime)."""
    if ranks is not None or not basics.is_initialized() or transport.size != basics.size():
        return None
    return engine.register_exchange(optimizer)


def _digest(optimizer: torch.optim.Optimizer) -> str:
    """A hash of the parameters, the state and the options, in the optimizer's own order."""
    h = hashlib.blake2b(digest_size=16)
    for group in optimizer.param_groups:
        h.update(repr(sorted((k, repr(v)) for k, v in group.items() if k != "params")).encode())
        for p in group["params"]:
            h.update(_bytes(p))
            state = optimizer.state.get(p) or {}
            for key in sorted(state, key=str):
                value = state[key]
                data = _bytes(value) if torch.is_tensor(value) else repr(value).encode()
                h.update(repr(key).encode() + data)
    return h.hexdigest()


def _bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes, whatever its dtype (numpy has no bfloat16 or float8: read as bytes)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def after_join(served: List[int], root: int) -> List[int]:
    """Collective, at the end of ``join`` on every rank: make each optimizer that exchanged
    while a rank had joined equal to ``root``'s (the last rank to join) where it is not. Returns
    the ids of the optimizers that were broadcast."""
    fixed = []
    for oid in served:
        opt = engine.registered(oid)
        digests = allgather_object(None if opt is None else _digest(opt),
                                   name=f"join: digest of DistributedOptimizer #{oid}")
        if None in digests:   # dropped on some rank: nothing to compare with there
            continue
        if len(set(digests)) == 1:
            continue
        params = [(f"group {g} param {i}", p) for g, group in enumerate(opt.param_groups)
                  for i, p in enumerate(group["params"])]
        broadcast_parameters(params, root)
        broadcast_optimizer_state(opt, root)
        fixed.append(oid)
    return fixed


def join(device: int = -1) -> int:
    """Wait until every rank has called ``join``, meanwhile taking part in the others' calls.

    Collective, as in Horovod: a rank that has joined (its calls queued before ``join`` done
    first) serves the collectives the other ranks still make until they too have joined. In
    an allreduce it contributes zeros (an ``Average`` still divides by ``size()``, as in
    Horovod); it waits in a barrier with them. An allgather, a broadcast or any other call
    made while a rank has joined raises a RuntimeError on the ranks that made it (Horovod
    refuses them too), and the joined rank goes on waiting. Each wait is bounded by
    ``HVD_SLIM_TIMEOUT``. Collectives on other process sets are not served: a joined rank
    in such a set keeps its other ranks waiting until they time out.

    A ``DistributedOptimizer`` on the whole job keeps training: a joined rank takes part in
    its exchanges with zero gradients and steps as the others do. When the last rank joins,
    each optimizer that stepped meanwhile is compared across ranks (a digest of parameters,
    state and options) and, if they differ (the others clipped or scaled between
    ``synchronize()`` and ``step()``), broadcast from the last rank to join, so every replica
    is equal again (:func:`after_join`). An optimizer inside a process set is not
    served.

    Args:
        device: Accepted for Horovod compatibility and ignored (default -1).

    Returns:
        The rank that joined last, the same on every rank: by the order of the collective
        rounds in which the ranks were seen joining (not by clocks); of ranks seen joining in
        the same round, the highest.

    Raises:
        MismatchError: ranks that have not joined made mismatched calls meanwhile (on those).
        TransportTimeout: a rank did not arrive within ``HVD_SLIM_TIMEOUT`` seconds.
    """
    drain_all()   # overlap_forward: this rank's last step lands before it is compared
    last, served = engine.submit("join", None, None, lambda jobs, rnd: None, Sig(JOIN, "join"),
                                 wait=True)
    drain_all()
    after_join(served, last)
    return int(last)
