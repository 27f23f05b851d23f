"""hvd_slim's steps: the single server as it is (:func:`hvd_slim`), sharded servers
(:func:`hvd_slim_sharded`) and ``hierarchical=True`` (:func:`hvd_slim_hier`). Their bytes come
from hvd_slim's own size functions (:mod:`.slim`); their collectives are MPI's (the
benchmark's transport): a point-to-point gather into the server, libnbc's ``Ibcast`` for the
pull (:mod:`.bcast`), and for shards every rank's pushes to every root at once and the roots'
pulls in one ``Iallgatherv`` (hvd_slim/transport/mpi_many.py at the results' commit)."""
from __future__ import annotations

from dataclasses import replace
from typing import List, Optional

from . import net as nw
from .bcast import bcast, libnbc_ibcast
from .push_queue import staggered_gather
from .scenario import PASSES, Prediction, Scenario, finish, serialized
from .slim import step_bytes
from .workloads import split

HEADER_ROW_BYTES = 44 * 8         # hvd_slim's header round: one int64 row per rank (engine_rounds)


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
    comm.add(staggered_gather(sc.net, n, root, b.push, sc.push_ready))
    comm.add(bcast(sc.net, n, root, 8, sc.bcast))
    comm.add(bcast(sc.net, n, root, b.pull, sc.bcast))
    algo = sc.bcast if sc.bcast != "libnbc" else libnbc_ibcast(n, b.pull)[0]
    return finish(peer, sc, worker + server, comm, b.push, b.pull, push=b.push, pull=b.pull,
                  k=b.k, k_pull=b.k_pull, pull_coords=b.pull_coords, pull_mode=b.pull_mode,
                  bcast=algo, select_s=sel, server_local_s=server, value_bits=s.value_bits)


def sharded_roots(n: int, servers: int, server_rank: int = 0) -> List[int]:
    """The shard roots, as hvd_slim.exchange.shards.server_roots places them."""
    return [(server_rank + s * n // servers) % n for s in range(servers)]


def hvd_slim_sharded(sc: Scenario, peer: str, select_s: Optional[float] = None,
                     density: Optional[float] = None, servers: int = 0) -> Prediction:
    """hvd_slim with ``servers`` shards (0: one per rank): the header round, every worker's
    pushes to every shard root at once (one phase), the roots' lengths (a small allgather),
    every root's pull to every rank at once (``Iallgatherv``, one phase), and the servers' work
    split S ways. Where roots are also workers, a pair of ranks sends each other its blocks over
    one connection: under ``sc.mpi == "openmpi-tcp"`` a block beyond 128 KiB serializes the two
    directions (:mod:`.openmpi`)."""
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
    both_ways = S > 1
    comm = nw.bruck_allgather(sc.net, n, HEADER_ROW_BYTES)
    comm.add(nw.phase(sc.net, n, [(j, r, b.push / S) for r in roots for j in range(n)],
                      nw.Tokens(sc.net, n), both_ways and serialized(sc, b.push / S)))
    comm.add(nw.bruck_allgather(sc.net, n, 8))
    comm.add(nw.phase(sc.net, n, [(r, j, b.pull / S) for r in roots for j in range(n)],
                      nw.Tokens(sc.net, n), both_ways and serialized(sc, b.pull / S)))
    return finish(peer, sc, worker + server, comm, b.push, b.pull, push=b.push, pull=b.pull,
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
    return finish(peer, sc, inner.local_s / L + host, comm, inner.sent_per_rank / L,
                  inner.recv_per_rank / L, hosts=H, local_size=L, host_local_s=host,
                  **{k: v for k, v in inner.detail.items() if k in ("push", "pull", "k")})
