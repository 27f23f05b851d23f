"""One steady-state data-parallel step per strategy: compute, then local work, then the
collectives, in series: every peer but Horovod exchanges after its backward (DDP's PowerSGD
runs one bucket, as the benchmark forces, so its hook fires at the end), and the synthetic
workloads' backward is one gradient copy. Horovod over a real backward (a scenario with a
measured ``ready`` profile) overlaps its allreduces with it: :mod:`.overlap`.

* compute: ``Scenario.compute_s`` (validation: the measured ``floor`` peer, which is the
  gradient copy and SGD's momentum step every peer also does).
* local work: selection seconds (measured, or per element) plus the streaming passes over the
  gradient and the scatters/gathers of sparse coordinates a strategy adds to the floor, counted
  from its code (:data:`~.scenario.PASSES`), at ``LocalCosts`` seconds per element.
* communication: the collectives of :mod:`.net`, :mod:`.bcast` and :mod:`.openmpi` on
  ``Scenario.net`` (which library runs which: :mod:`.scenario`).

Strategies are looked up by the benchmark's peer names (``parse``), so predictions join
measurements; :data:`STRATEGIES` maps a family to its function (hvd_slim's three, the single
server, sharded servers and ``hierarchical=True``, are in :mod:`.slim_steps`).
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from . import net as nw
from .scenario import (FLOOR_PASSES, PASSES, LocalCosts, Prediction, Scenario, allgather,
                       allreduce, finish, ring_bytes)
from .overlap import FUSION_BYTES as HOROVOD_FUSION_BYTES
from .overlap import horovod_overlapped
from .slim_steps import hvd_slim, hvd_slim_hier, hvd_slim_sharded
from .workloads import powersgd_sizes, split

__all__ = ["FLOOR_PASSES", "PASSES", "LocalCosts", "Prediction", "Scenario", "STRATEGIES",
           "parse", "predict", "predict_all"]

DDP_BUCKET_BYTES = 25 << 20       # DDP's bucket_cap_mb default: one allreduce per bucket
TOPK_ITEM_BYTES = 8               # benchmarks.peers.TopKAllgather: int32 index + fp32 value
SMALL_NUMEL = 4096                # benchmarks.peers.SMALL_NUMEL: top-k's dense threshold


def floor(sc: Scenario, peer: str, select_s: Optional[float] = None) -> Prediction:
    """Compute only."""
    return finish(peer, sc, 0.0, nw.Cost(), 0.0, 0.0)


def dense(sc: Scenario, peer: str, select_s: Optional[float] = None) -> Prediction:
    """fp32 (or fp16) dense allreduce of every gradient: MPI, Horovod (over MPI) or DDP over
    Gloo. Horovod with a measured backward profile overlaps it (:mod:`.overlap`)."""
    itemsize = 2 if peer.endswith("fp16") else 4
    if peer.startswith("horovod") and sc.ready:
        return horovod_overlapped(sc, peer, itemsize, PASSES[peer] * sc.d * sc.local.pass_s)
    nbytes = itemsize * sc.d
    gloo = peer.startswith("ddp")
    cap = DDP_BUCKET_BYTES if gloo else \
        HOROVOD_FUSION_BYTES if peer.startswith("horovod") else math.inf
    comm = allreduce(sc, nbytes, cap, gloo=gloo)
    local = PASSES[peer] * sc.d * sc.local.pass_s
    wire = ring_bytes(nbytes, sc.ranks)
    return finish(peer, sc, local, comm, wire, wire, handed=nbytes, allreduces=comm.phases)


def powersgd(sc: Scenario, peer: str, select_s: Optional[float] = None, rank: int = 1
             ) -> Prediction:
    """torch's ``powerSGD_hook`` (one bucket, as the benchmark forces): three Gloo allreduces
    in turn, the uncompressed tensors, then P, then Q, all fp32."""
    p, q, unc = powersgd_sizes(sc.shapes, rank)
    comm = nw.Cost()
    for elems in (unc, p, q):
        comm.add(allreduce(sc, 4 * elems, gloo=True))
    handed = 4 * (p + q + unc)
    local = PASSES["ddp-powersgd"] * sc.d * sc.local.pass_s
    wire = ring_bytes(handed, sc.ranks)
    return finish(peer, sc, local, comm, wire, wire, handed=handed, p=p, q=q, uncompressed=unc)


def topk(sc: Scenario, peer: str, select_s: Optional[float] = None, density: float = 0.01
         ) -> Prediction:
    """benchmarks.peers.TopKAllgather: exact top-k with error feedback over the tensors of at
    least SMALL_NUMEL elements, an MPI allgather of (int32, fp32) pairs, the rest allreduced
    (MPI)."""
    big, small = split(sc.shapes, SMALL_NUMEL)
    n = sc.ranks
    k = min(big, max(1, math.ceil(density * big))) if big else 0
    payload = TOPK_ITEM_BYTES * k
    comm = allgather(sc, payload).add(allreduce(sc, 4 * small))
    sel = big * sc.local.topk_select_s if select_s is None else select_s
    # scatters: the average's n index_add_ of k, the values read and zeroed in the residual
    local = sel + PASSES["topk-ef"] * sc.d * sc.local.pass_s + (n + 2) * k * sc.local.scatter
    wire = (n - 1) * payload + ring_bytes(4 * small, n)
    return finish(peer, sc, local, comm, wire, wire, k=k, payload=payload, select_s=sel)


StrategyFn = Callable[..., Prediction]
STRATEGIES: Dict[str, StrategyFn] = {
    "floor": floor, "mpi-allreduce": dense, "horovod": dense, "horovod-fp16": dense,
    "ddp-allreduce": dense, "ddp-fp16": dense, "ddp-powersgd": powersgd, "topk-ef": topk,
    "hvd_slim": hvd_slim, "hvd_slim-sharded": hvd_slim_sharded, "hvd_slim-hier": hvd_slim_hier}

_PARAM = [(re.compile(r"^ddp-powersgd-r(\d+)$"), "ddp-powersgd", lambda m: {"rank": int(m[1])}),
          (re.compile(r"^topk-ef@([0-9.eE+-]+)$"), "topk-ef", lambda m: {"density": float(m[1])}),
          (re.compile(r"^hvd_slim-(slim|union)@([0-9.eE+-]+)$"), "hvd_slim",
           lambda m: {"pull": m[1], "density": float(m[2])}),
          (re.compile(r"^hvd_slim-sharded@([0-9.eE+-]+)$"), "hvd_slim-sharded",
           lambda m: {"density": float(m[1])}),
          (re.compile(r"^hvd_slim-hier@([0-9.eE+-]+)$"), "hvd_slim-hier",
           lambda m: {"density": float(m[1])})]


def parse(peer: str) -> Tuple[str, Dict[str, Any]]:
    """(family, parameters) of a benchmark peer name; ValueError for an unknown one."""
    if peer in STRATEGIES:
        return peer, {}
    for rx, family, params in _PARAM:
        m = rx.match(peer)
        if m:
            return family, params(m)
    raise ValueError(f"no model for peer {peer!r}; families: {sorted(STRATEGIES)}")


def predict(peer: str, sc: Scenario, select_s: Optional[float] = None) -> Prediction:
    """The prediction for benchmark peer ``peer`` (e.g. "hvd_slim-slim@0.01") in ``sc``;
    ``select_s`` is a measured selection time per step that replaces the per-element one."""
    sc.net.check(sc.ranks)
    family, params = parse(peer)
    return STRATEGIES[family](sc, peer, select_s, **params)


def predict_all(peers: Sequence[str], sc: Scenario) -> Dict[str, Prediction]:
    return {p: predict(p, sc) for p in peers}
