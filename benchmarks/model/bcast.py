"""Broadcasts: hvd_slim's pull is ``MPI_Ibcast``, which Open MPI 4.1 serves by libnbc
(ompi/mca/coll/libnbc/nbc_ibcast.c); :func:`libnbc_ibcast` is its choice of algorithm. Every
broadcast starts with the token buckets full (:class:`~.net.Tokens`): it follows the server's
aggregation, and its NICs were idle during the push (the root's transmit direction) or the
local work (the others' receive direction)."""
from __future__ import annotations

import math
from typing import List, Tuple

from .net import Cost, Network, Tokens, counters, phase


def bcast_linear(net: Network, n: int, root: int, nbytes: float) -> Cost:
    """The root sends the whole message to every rank at once."""
    return phase(net, n, ((root, j, nbytes) for j in range(n) if j != root), Tokens(net, n))


def vrank_to_rank(vrank: int, root: int) -> int:
    """libnbc's virtual ranks: the root is vrank 0 and rank 0 takes the root's place."""
    return root if vrank == 0 else (0 if vrank == root else vrank)


def binomial_children(v: int, n: int) -> List[int]:
    """The vranks that vrank ``v`` sends to in libnbc's binomial tree: ``v + 2^r`` for every
    ``2^r > v`` below ``n`` (the root: 1, 2, 4, ...; vrank 1: 3, 5, ...)."""
    rounds = math.ceil(math.log2(n)) if n > 1 else 0
    return [v + (1 << r) for r in range(rounds) if v < (1 << r) and v + (1 << r) < n]


def bcast_binomial(net: Network, n: int, root: int, nbytes: float) -> Cost:
    """libnbc's binomial schedule (``bcast_sched_binomial``): a vrank receives from its parent,
    then sends to all of its children at once, in one round (no barrier between the sends).
    So the root's NIC carries ``ceil(log2 n)`` copies together, and a child forwards only once
    its own copy, slowed by its siblings', is in: at 8 ranks the path 0 -> 1 -> 3 -> 7 takes
    3 + 2 + 1 message times. Each parent's sends are one :func:`~.net.phase` that starts when
    its copy arrived; on a shared link the whole load is a bound too."""
    ends = net.endpoints(n)
    out = Cost(0.0, [0.0] * ends, [0.0] * ends, 0)
    if n < 2 or nbytes <= 0:
        return out
    tokens = Tokens(net, n)
    arrival, depth = {0: 0.0}, {0: 0}
    for v in range(n):                     # a parent's vrank is below its children's
        kids = binomial_children(v, n)
        if not kids:
            continue
        sends = phase(net, n, ((vrank_to_rank(v, root), vrank_to_rank(c, root), nbytes)
                               for c in kids), tokens)
        for c in kids:
            arrival[c], depth[c] = arrival[v] + sends.seconds, depth[v] + 1
        out.tx = [a + b for a, b in zip(out.tx, sends.tx)]
        out.rx = [a + b for a, b in zip(out.rx, sends.rx)]
    out.seconds, out.phases = max(arrival.values()), max(depth.values())
    if net.shared:
        out.seconds = max(out.seconds, 8 * (n - 1) * nbytes / net.rate() + net.latency_s)
    return out


def bcast_chain(net: Network, n: int, root: int, nbytes: float, seg: float = 32768) -> Cost:
    """A pipelined chain vrank 0 -> 1 -> ... -> n-1 in segments of ``seg`` bytes: every rank
    but the last forwards the message once. Time: the pipeline (``nseg + n - 2`` segment slots
    on the slowest link) or the load bound (a shared link carries ``(n-1) * nbytes``), whichever
    is longer, plus one overhead per segment (libnbc waits for each segment's send before the
    next) and one latency per hop. A full token bucket passes its bytes without a slot: the
    pipeline then counts the segments beyond the smallest bucket on the chain, the load bound
    each NIC's bytes beyond its own bucket."""
    ends = net.endpoints(n)
    out = Cost(0.0, [0.0] * ends, [0.0] * ends, 0)
    if n < 2 or nbytes <= 0:
        return out
    nseg = math.ceil(nbytes / seg)
    slot, free = 0.0, math.inf
    for v in range(n - 1):
        a, b = net.endpoint(vrank_to_rank(v, root)), net.endpoint(vrank_to_rank(v + 1, root))
        if a != b:
            out.tx[a] += nbytes
            out.rx[b] += nbytes
            slot = max(slot, 8 * min(seg, nbytes) / min(net.rate(a), net.rate(b)))
            free = min(free, net.burst(a), net.burst(b))
    tokens = Tokens(net, n)
    if net.shared:
        load = 8 * tokens.spend((0, "link"), sum(out.tx)) / net.rate()
    else:
        load = max((8 * max(tokens.spend((h, "tx"), t), tokens.spend((h, "rx"), r)) / net.rate(h)
                    for h, (t, r) in enumerate(zip(out.tx, out.rx))), default=0.0)
    paid = math.ceil(max(0.0, nbytes - (0.0 if free == math.inf else free)) / seg)
    out.seconds = max((paid + n - 2) * slot if paid else 0.0, load) + nseg * net.overhead_s + \
        (n - 1) * net.latency_s
    out.phases = nseg + n - 2
    out.tx, out.rx = counters(net, out.tx, out.rx)
    return out


def libnbc_ibcast(n: int, nbytes: float, skip_dt_decision: bool = True) -> Tuple[str, int]:
    """The algorithm Open MPI 4.1's libnbc (which serves ``MPI_Ibcast`` by default, and so
    hvd_slim's pull) picks (ompi/mca/coll/libnbc/nbc_ibcast.c). By default
    (``coll_libnbc_ibcast_skip_dt_decision`` true, as ``ompi_info --param coll libnbc --level 9``
    shows for the benchmark's Open MPI 4.1.4) only the communicator's size decides: linear up to
    4 ranks, binomial above, whatever the message. The switched NIC counters agree: at 8 hosts
    the 0.37 MB union pull left host 0 three times, host 1 twice, hosts 2 and 3 once
    (``cluster_rerun/scaling_cnn1m_8h_100m``), a binomial tree, not a chain. With the datatype
    decision (``skip_dt_decision=False``): binomial under 64 KiB, else a chain of 8 KiB segments
    under 512 KiB and of 32 KiB ones above."""
    if n <= 4:
        return "linear", 0
    if skip_dt_decision or nbytes < 65536:
        return "binomial", 0
    return ("chain", 8192) if nbytes < 524288 else ("chain", 32768)


def bcast(net: Network, n: int, root: int, nbytes: float, algo: str = "libnbc") -> Cost:
    """A broadcast by ``algo``: ``libnbc`` (its own choice, see :func:`libnbc_ibcast`),
    ``linear``, ``binomial`` or ``chain`` (32 KiB segments)."""
    seg = 32768
    if algo == "libnbc":
        algo, seg = libnbc_ibcast(n, nbytes)
    if algo == "linear":
        return bcast_linear(net, n, root, nbytes)
    if algo == "binomial":
        return bcast_binomial(net, n, root, nbytes)
    if algo == "chain":
        return bcast_chain(net, n, root, nbytes, seg)
    raise ValueError(f"unknown broadcast algorithm {algo!r}")
