"""Broadcasts: hvd_slim's pull is ``MPI_Ibcast``, which Open MPI 4.1 serves by libnbc
(ompi/mca/coll/libnbc/nbc_ibcast.c); :func:`libnbc_ibcast` is its choice of algorithm. Every
broadcast starts with the token buckets full (:class:`~.net.Tokens`): it follows the server's
aggregation, and its NICs were idle during the push (the root's transmit direction) or the
local work (the others' receive direction)."""
from __future__ import annotations

import math
from typing import Tuple

from .net import Cost, Network, Tokens, counters, empty, phase


def bcast_linear(net: Network, n: int, root: int, nbytes: float) -> Cost:
    """The root sends the whole message to every rank at once."""
    return phase(net, n, ((root, j, nbytes) for j in range(n) if j != root), Tokens(net, n))


def vrank_to_rank(vrank: int, root: int) -> int:
    """libnbc's virtual ranks: the root is vrank 0 and rank 0 takes the root's place."""
    return root if vrank == 0 else (0 if vrank == root else vrank)


def bcast_binomial(net: Network, n: int, root: int, nbytes: float) -> Cost:
    """``ceil(log2 n)`` rounds; in round r every vrank below ``2^r`` that has the message sends
    it to vrank ``+ 2^r``."""
    out, tokens = empty(net, n), Tokens(net, n)
    for r in range(math.ceil(math.log2(n)) if n > 1 else 0):
        out.add(phase(net, n, ((vrank_to_rank(v, root), vrank_to_rank(v + (1 << r), root),
                                nbytes) for v in range(1 << r) if v + (1 << r) < n), tokens))
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


def libnbc_ibcast(n: int, nbytes: float) -> Tuple[str, int]:
    """The algorithm Open MPI's libnbc (which serves ``MPI_Ibcast`` by default, and so
    hvd_slim's pull) picks: linear up to 4 ranks, binomial under 64 KiB, else a chain of 8 KiB
    segments under 512 KiB and of 32 KiB ones above (ompi/mca/coll/libnbc/nbc_ibcast.c)."""
    if n <= 4:
        return "linear", 0
    if nbytes < 65536:
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
