"""One steady-state data-parallel step per strategy: compute, then local work, then the
collectives, in series (the benchmark's backward is one gradient copy and every peer exchanges
after it, so nothing overlaps).

* compute: ``Scenario.compute_s`` (validation: the measured ``floor`` peer, which is the
  gradient copy and SGD's momentum step every peer also does).
* local work: selection seconds (measured, or per element) plus the streaming passes over the
  gradient and the scatters/gathers of sparse coordinates a strategy adds to the floor, counted
  from its code (:data:`PASSES`), at ``LocalCosts`` seconds per element.
* communication: :mod:`benchmarks.model.net`'s collectives on ``Scenario.net``.

Strategies are looked up by the benchmark's peer names (``parse``), so predictions join
measurements; :data:`STRATEGIES` maps a family to its function (sharded servers and
``hierarchical=True`` have theirs).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import net as nw
from .slim import SlimSettings, step_bytes
from .workloads import Shape, numel, powersgd_sizes, split

# Streaming passes over the gradient's d elements that a strategy adds to the floor's step
# (the floor's own, FLOOR_PASSES: the gradient copy and SGD momentum's mul_, add_ and the
# parameter update). Counted from the code, never fitted.
FLOOR_PASSES = 4
PASSES: Dict[str, float] = {
    "mpi-allreduce": 3,   # torch.cat into the buffer, MPI's sum ((n-1)/n d adds), div_
    "horovod": 4,         # fusion buffer in and out, MPI's sum, the average
    "horovod-fp16": 6,    # ... and the casts to fp16 and back
    "ddp-allreduce": 4,   # bucket copy in and out, Gloo's sum, div_
    "ddp-fp16": 6,        # ... and the casts
    "ddp-powersgd": 8,    # bucket in/out, error add_, clone, M Q, M^T P, P Q^T, the new error
    "topk-ef": 4,         # cat, residual add_, the average's zero_ and div_
    "hvd_slim": 4,        # u' = g + m u, a = r + u' (fused passes), the NaN/Inf sum, pull zero_
    "hvd_slim-server-dense": 3,   # a dense aggregate (union or dense pull): zero_, nonzero/+e, mul_
    # hierarchical=True's host phases, per rank over d: the reduction's encode (1), sending and
    # receiving (L-1)/L of it (a copy each way), the clone, the (L-1)/L adds and the mean of
    # one piece (1/L each), and the spread's write into every .grad with its cat (2)
    "hvd_slim-hier-host": 3,      # plus 3 (L-1)/L + 2/L, added in hvd_slim_hier
}
DDP_BUCKET_BYTES = 25 << 20       # DDP's bucket_cap_mb default: one allreduce per bucket
HOROVOD_FUSION_BYTES = 64 << 20   # Horovod's fusion threshold
HEADER_ROW_BYTES = 44 * 8         # hvd_slim's header round: one int64 row per rank (engine_rounds)
TOPK_ITEM_BYTES = 8               # benchmarks.peers.TopKAllgather: int32 index + fp32 value
SMALL_NUMEL = 4096                # benchmarks.peers.SMALL_NUMEL: top-k's dense threshold


@dataclass(frozen=True)
class LocalCosts:
    """Per-element seconds of this machine's O(d) local work (0: communication only)."""

    pass_s: float = 0.0               # one streaming pass over an fp32 vector
    scatter_s: Optional[float] = None  # one indexed read or add (None: pass_s)
    topk_select_s: float = 0.0        # torch.topk(|a|, k), per compressed element
    slim_select_s: float = 0.0        # hvd_slim's core selection, per compressed element

    @property
    def scatter(self) -> float:
        return self.pass_s if self.scatter_s is None else self.scatter_s


@dataclass(frozen=True)
class Scenario:
    """Everything a prediction needs but the strategy."""

    ranks: int
    net: nw.Network
    shapes: Tuple[Shape, ...]
    compute_s: float = 0.0
    local: LocalCosts = LocalCosts()
    slim: SlimSettings = SlimSettings()
    allreduce: str = "ring"           # a key of net.ALLREDUCE (Open MPI, Gloo: ring-like)
    bcast: str = "libnbc"             # hvd_slim's pull: see net.bcast

    @property
    def d(self) -> int:
        return numel(self.shapes)


@dataclass
class Prediction:
    """Seconds of one step by part, NIC bytes per endpoint, and the per-rank bytes as the
    benchmark's ``bytes_sent_per_step``/``bytes_recv_per_step`` define them."""

    peer: str
    seconds: float
    compute_s: float
    local_s: float
    comm_s: float
    tx: List[float]
    rx: List[float]
    sent_per_rank: float
    recv_per_rank: float
    detail: Dict[str, Any] = field(default_factory=dict)

    @property
    def busiest_tx(self) -> float:
        return max(self.tx, default=0.0)

    @property
    def busiest_rx(self) -> float:
        return max(self.rx, default=0.0)


def _finish(peer: str, sc: Scenario, local: float, comm: nw.Cost, sent: float, recv: float,
            **detail: Any) -> Prediction:
    ends = sc.net.endpoints(sc.ranks)
    comm.tx += [0.0] * (ends - len(comm.tx))
    comm.rx += [0.0] * (ends - len(comm.rx))
    return Prediction(peer, sc.compute_s + local + comm.seconds, sc.compute_s, local,
                      comm.seconds, comm.tx, comm.rx, sent, recv, dict(detail))


def _allreduce(sc: Scenario, nbytes: float, cap: float = math.inf) -> nw.Cost:
    """One allreduce per ``cap`` bytes (DDP's buckets, Horovod's fusion buffer)."""
    out = nw.Cost()
    left = float(nbytes)
    fn = nw.ALLREDUCE[sc.allreduce]
    while left > 0:
        out.add(fn(sc.net, sc.ranks, min(cap, left)))
        left -= cap
    return out


def _ring_bytes(nbytes: float, n: int) -> float:
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0


# --- strategies ------------------------------------------------------------------------------
def floor(sc: Scenario, peer: str, select_s: Optional[float] = None) -> Prediction:
    """Compute only."""
    return _finish(peer, sc, 0.0, nw.Cost(), 0.0, 0.0)


def dense(sc: Scenario, peer: str, select_s: Optional[float] = None) -> Prediction:
    """fp32 (or fp16) dense allreduce of every gradient: MPI, Horovod or DDP over Gloo."""
    itemsize = 2 if peer.endswith("fp16") else 4
    nbytes = itemsize * sc.d
    cap = DDP_BUCKET_BYTES if peer.startswith("ddp") else \
        HOROVOD_FUSION_BYTES if peer.startswith("horovod") else math.inf
    comm = _allreduce(sc, nbytes, cap)
    local = PASSES[peer] * sc.d * sc.local.pass_s
    wire = _ring_bytes(nbytes, sc.ranks)
    return _finish(peer, sc, local, comm, wire, wire, handed=nbytes, allreduces=comm.phases)


def powersgd(sc: Scenario, peer: str, select_s: Optional[float] = None, rank: int = 1
             ) -> Prediction:
    """torch's ``powerSGD_hook`` (one bucket, as the benchmark forces): three allreduces in
    turn, the uncompressed tensors, then P, then Q, all fp32."""
    p, q, unc = powersgd_sizes(sc.shapes, rank)
    comm = nw.Cost()
    for elems in (unc, p, q):
        comm.add(_allreduce(sc, 4 * elems))
    handed = 4 * (p + q + unc)
    local = PASSES["ddp-powersgd"] * sc.d * sc.local.pass_s
    wire = _ring_bytes(handed, sc.ranks)
    return _finish(peer, sc, local, comm, wire, wire, handed=handed, p=p, q=q, uncompressed=unc)


def topk(sc: Scenario, peer: str, select_s: Optional[float] = None, density: float = 0.01
         ) -> Prediction:
    """benchmarks.peers.TopKAllgather: exact top-k with error feedback over the tensors of at
    least SMALL_NUMEL elements, a ring allgather of (int32, fp32) pairs, the rest allreduced."""
    big, small = split(sc.shapes, SMALL_NUMEL)
    n = sc.ranks
    k = min(big, max(1, math.ceil(density * big))) if big else 0
    payload = TOPK_ITEM_BYTES * k
    comm = nw.ring_allgather(sc.net, n, payload).add(_allreduce(sc, 4 * small))
    sel = big * sc.local.topk_select_s if select_s is None else select_s
    # scatters: the average's n index_add_ of k, the values read and zeroed in the residual
    local = sel + PASSES["topk-ef"] * sc.d * sc.local.pass_s + (n + 2) * k * sc.local.scatter
    wire = (n - 1) * payload + _ring_bytes(4 * small, n)
    return _finish(peer, sc, local, comm, wire, wire, k=k, payload=payload, select_s=sel)


def hvd_slim(sc: Scenario, peer: str, select_s: Optional[float] = None,
             density: Optional[float] = None, pull: Optional[str] = None) -> Prediction:
    """hvd_slim's steady-state step: header round (a small allgather), every worker's push to
    the server (point-to-point, into one NIC), the server's aggregation and pull selection, the
    pull's broadcast (its length word, then the payload), the workers' apply."""
    s = sc.slim
    if density is not None or pull is not None:
        s = replace(s, density=density or s.density, pull=pull or s.pull)
    n, root = sc.ranks, s.server_rank
    big, small = split(sc.shapes, s.min_compress_numel)
    b = step_bytes(big, small, n, s)
    sel = big * sc.local.slim_select_s if select_s is None else select_s
    if b.push_mode != "slice":   # the dense fallback selects nothing
        sel = 0.0
    lc = sc.local
    # Worker: passes, the sliced values read and forgotten (2k), the pull scattered.
    worker = sel + PASSES["hvd_slim"] * sc.d * lc.pass_s + (2 * b.k + b.pull_coords) * lc.scatter
    if s.pull == "slim":
        # The server selects its pull core by the same selector over the same d (taken to cost
        # what the worker's selection does), after n index_add_ of k into its residual (and
        # saving the old values there: 2nk), then reads and forgets k_pull.
        server = (sel if b.pull_mode == "slice" else PASSES["hvd_slim-server-dense"] * big *
                  lc.pass_s) + (2 * n * b.k + 2 * b.k_pull) * lc.scatter
    else:
        server = PASSES["hvd_slim-server-dense"] * big * lc.pass_s + \
            (2 * n * b.k + b.pull_coords) * lc.scatter
    comm = nw.bruck_allgather(sc.net, n, HEADER_ROW_BYTES)
    comm.add(nw.gather(sc.net, n, root, b.push))
    comm.add(nw.bcast(sc.net, n, root, 8, sc.bcast))
    comm.add(nw.bcast(sc.net, n, root, b.pull, sc.bcast))
    algo = sc.bcast if sc.bcast != "libnbc" else nw.libnbc_ibcast(n, b.pull)[0]
    return _finish(peer, sc, worker + server, comm, b.push, b.pull, push=b.push, pull=b.pull,
                   k=b.k, k_pull=b.k_pull, pull_coords=b.pull_coords, pull_mode=b.pull_mode,
                   bcast=algo, select_s=sel, server_local_s=server, value_bits=s.value_bits)


def sharded_roots(n: int, servers: int, server_rank: int = 0) -> List[int]:
    """The shard roots, as hvd_slim.exchange.shards.server_roots places them."""
    return [(server_rank + s * n // servers) % n for s in range(servers)]


def _bcast_edges(n: int, root: int, nbytes: float) -> List[Tuple[int, int, float]]:
    """The edges one broadcast of libnbc's choice uses (every edge carries the message once)."""
    algo, _ = nw.libnbc_ibcast(n, nbytes)
    if algo == "linear":
        return [(root, j, nbytes) for j in range(n) if j != root]
    if algo == "binomial":
        return [(nw._rank(v, root), nw._rank(v + (1 << r), root), nbytes)
                for r in range(math.ceil(math.log2(n))) for v in range(1 << r) if v + (1 << r) < n]
    return [(nw._rank(v, root), nw._rank(v + 1, root), nbytes) for v in range(n - 1)]


def hvd_slim_sharded(sc: Scenario, peer: str, select_s: Optional[float] = None,
                     density: Optional[float] = None, servers: int = 0) -> Prediction:
    """hvd_slim with ``servers`` shards (0: one per rank): the header round, every worker's
    pushes to every shard root at once (one phase), the roots' lengths (a small allgather),
    every root's pull broadcast at once (one phase carrying all their edges, as many latencies
    as the deepest), and the servers' work split S ways."""
    s = sc.slim if density is None else replace(sc.slim, density=density)
    s = replace(s, pull="slim")
    n = sc.ranks
    S = servers or n
    roots = sharded_roots(n, S, s.server_rank)
    big, small = split(sc.shapes, s.min_compress_numel)
    b = step_bytes(big, small, n, s)
    sel = big * sc.local.slim_select_s if select_s is None else select_s
    if b.push_mode != "slice":
        sel = 0.0
    lc = sc.local
    worker = sel + PASSES["hvd_slim"] * sc.d * lc.pass_s + (2 * b.k + b.pull_coords) * lc.scatter
    server = ((sel if b.pull_mode == "slice" else PASSES["hvd_slim-server-dense"] * big *
               lc.pass_s) + (2 * n * b.k + 2 * b.k_pull) * lc.scatter) / S
    comm = nw.bruck_allgather(sc.net, n, HEADER_ROW_BYTES)
    comm.add(nw.phase(sc.net, n, [(j, r, b.push / S) for r in roots for j in range(n)]))
    comm.add(nw.bruck_allgather(sc.net, n, 8))
    edges = [e for r in roots for e in _bcast_edges(n, r, b.pull / S)]
    depth = 1 if nw.libnbc_ibcast(n, b.pull / S)[0] == "linear" else \
        math.ceil(math.log2(n)) if nw.libnbc_ibcast(n, b.pull / S)[0] == "binomial" else n - 1
    pull = nw.phase(sc.net, n, edges)
    pull.seconds += (depth - 1) * sc.net.latency_s
    comm.add(pull)
    return _finish(peer, sc, worker + server, comm, b.push, b.pull, push=b.push, pull=b.pull,
                   k=b.k, k_pull=b.k_pull, servers=S, select_s=sel, server_local_s=server,
                   value_bits=s.value_bits)


def hvd_slim_hier(sc: Scenario, peer: str, select_s: Optional[float] = None,
                  density: Optional[float] = None) -> Prediction:
    """hvd_slim with ``hierarchical=True`` on hosts of L = ``net.ranks_per_host`` ranks: the host
    phases (memory traffic, no NIC bytes), then L cross exchanges at once, one per local rank,
    each hvd_slim's step among the H hosts on 1/L of the model: together they put one flat
    exchange's bytes among H ranks on each NIC, and each rank does 1/L of its local work."""
    L = sc.net.ranks_per_host
    if sc.net.shared or L == 1:
        return hvd_slim(sc, peer, select_s, density, "slim")
    H = sc.ranks // L
    cross = replace(sc, ranks=H, net=replace(sc.net, ranks_per_host=1), compute_s=0.0)
    inner = hvd_slim(cross, peer, None if select_s is None else select_s * L, density, "slim")
    host = (PASSES["hvd_slim-hier-host"] + 3 * (L - 1) / L + 2 / L) * sc.d * sc.local.pass_s
    comm = nw.Cost(seconds=inner.comm_s, tx=list(inner.tx), rx=list(inner.rx))
    return _finish(peer, sc, inner.local_s / L + host, comm, inner.sent_per_rank / L,
                   inner.recv_per_rank / L, hosts=H, local_size=L, host_local_s=host,
                   **{k: v for k, v in inner.detail.items() if k in ("push", "pull", "k")})


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
