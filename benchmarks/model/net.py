"""Topologies and the transfer primitives every modelled collective is built from.

A collective is a sequence of *phases*; in a phase a set of flows ``(src rank, dst rank, bytes)``
runs concurrently and the phase ends when the last flow does. A phase costs its bandwidth term
plus one one-way latency and a per-message software overhead for each message the busiest rank
handles:

* ``switched``: every host has its own full-duplex NIC (its own rate) into a non-blocking switch.
  The bandwidth term is the busiest NIC's load over its rate, ``max_h max(tx_h, rx_h) / r_h``
  (flows into one NIC share it). This is the fluid bound, which a preemptive schedule of the
  flows achieves; a flow between ranks of one host does not touch the NIC (free).
* ``shared`` (and ``loopback``, a shared link at a high rate): every byte any rank sends crosses
  the one link, ``sum(bytes) / r``. On a loopback each byte is one packet on ``lo``, counted once.

Rates are bits/s; ``efficiency`` (the achieved share of line rate, e.g. the benchmark's
pingpong over the nominal rate) scales every rate. NIC counters (``tx``/``rx`` per endpoint: a
host when switched, a rank when shared) are payload bytes times ``frame_overhead``
(Ethernet/IP/TCP framing as an interface counter sees it) plus ``ack_overhead`` times the bytes
received (the ACKs going back).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Tuple

TOPOLOGIES = ("switched", "shared", "loopback")
Flow = Tuple[int, int, float]   # (source rank, destination rank, bytes)
# Interface counters of an MTU-1500 TCP link: a 1448-byte payload (timestamps on) leaves as a
# 1514-byte frame (14 Ethernet + 20 IP + 32 TCP header bytes), and the receiver answers every
# second segment with a 66-byte ACK (delayed ACKs), counted on its transmit side.
ETH_FRAME_OVERHEAD = 1514 / 1448
ETH_ACK_OVERHEAD = 66 / (2 * 1448)


@dataclass(frozen=True)
class Network:
    """Where the bytes go: topology, per-host rates (bits/s) and per-message costs (s)."""

    topology: str
    rate_bps: Tuple[float, ...]          # one per host, or a single rate for every host / link
    latency_s: float = 5e-6              # one-way latency of a message
    overhead_s: float = 0.0              # per-message software overhead (MPI, TCP stack)
    efficiency: float = 1.0              # achieved fraction of the rate
    ranks_per_host: int = 1              # switched only: ranks r*k .. r*k+k-1 share host r
    frame_overhead: float = 1.0          # NIC-counter bytes per payload byte
    ack_overhead: float = 0.0            # NIC-counter bytes sent back per payload byte received

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        rates = tuple(float(r) for r in (self.rate_bps if isinstance(self.rate_bps, Iterable)
                                         else (self.rate_bps,)))
        if not rates or min(rates) <= 0:
            raise ValueError(f"rates must be positive bits/s, got {self.rate_bps!r}")
        object.__setattr__(self, "rate_bps", rates)
        if not 0 < self.efficiency <= 1.5 or self.ranks_per_host < 1:
            raise ValueError("efficiency must be in (0, 1.5] and ranks_per_host >= 1")

    @property
    def shared(self) -> bool:
        return self.topology != "switched"

    def endpoints(self, n: int) -> int:
        """How many NIC counters an ``n``-rank job has: hosts (switched) or ranks (shared)."""
        return n if self.shared else -(-n // self.ranks_per_host)

    def endpoint(self, rank: int) -> int:
        return rank if self.shared else rank // self.ranks_per_host

    def rate(self, endpoint: int = 0) -> float:
        """Effective bits/s of a host's NIC (switched) or of the link (shared)."""
        r = self.rate_bps[0] if self.shared or len(self.rate_bps) == 1 else self.rate_bps[endpoint]
        return r * self.efficiency

    def check(self, n: int) -> None:
        hosts = self.endpoints(n)
        if not self.shared and len(self.rate_bps) not in (1, hosts):
            raise ValueError(f"{hosts} hosts but {len(self.rate_bps)} rates: give one or one "
                             "per host")


@dataclass
class Cost:
    """Seconds, NIC bytes per endpoint and phases (latency steps) of a piece of a step."""

    seconds: float = 0.0
    tx: List[float] = field(default_factory=list)
    rx: List[float] = field(default_factory=list)
    phases: int = 0

    def _pad(self, n: int) -> None:
        self.tx += [0.0] * (n - len(self.tx))
        self.rx += [0.0] * (n - len(self.rx))

    def add(self, other: "Cost", times: float = 1.0) -> "Cost":
        """Append ``other`` ``times`` over (sequentially), in place; returns self."""
        self._pad(max(len(self.tx), len(other.tx)))
        for i, (t, r) in enumerate(zip(other.tx, other.rx)):
            self.tx[i] += times * t
            self.rx[i] += times * r
        self.seconds += times * other.seconds
        self.phases += int(round(times * other.phases))
        return self


def phase(net: Network, n: int, flows: Iterable[Flow]) -> Cost:
    """One phase: ``flows`` concurrently, then one latency, and the per-message overhead once
    for every message the busiest rank handles (a rank's sends overlap its receives; the root
    of a gather or a linear broadcast handles n-1 in turn)."""
    ends = net.endpoints(n)
    tx, rx = [0.0] * ends, [0.0] * ends
    sends: Dict[int, int] = {}
    recvs: Dict[int, int] = {}
    any_flow = False
    for src, dst, nbytes in flows:
        if nbytes <= 0 or src == dst:
            continue
        any_flow = True
        sends[src] = sends.get(src, 0) + 1
        recvs[dst] = recvs.get(dst, 0) + 1
        a, b = net.endpoint(src), net.endpoint(dst)
        if a == b:        # two ranks of one host: shared memory, not the NIC
            continue
        tx[a] += nbytes
        rx[b] += nbytes
    if not any_flow:
        return Cost(0.0, tx, rx, 0)
    if net.shared:
        bw = 8 * sum(tx) / net.rate()
    else:
        bw = max((8 * max(t, r) / net.rate(h) for h, (t, r) in enumerate(zip(tx, rx))),
                 default=0.0)
    msgs = max(max(sends.values()), max(recvs.values()))
    return Cost(bw + net.latency_s + msgs * net.overhead_s, *counters(net, tx, rx), 1)


def counters(net: Network, tx: List[float], rx: List[float]) -> Tuple[List[float], List[float]]:
    """What interface counters show for payload bytes ``tx``/``rx`` per endpoint: framing on
    the data, and the ACKs of what an endpoint receives on its transmit side."""
    f, a = net.frame_overhead, net.ack_overhead
    return ([f * t + a * r for t, r in zip(tx, rx)], [f * r + a * t for t, r in zip(tx, rx)])


# --- allreduce -------------------------------------------------------------------------------
def ring_allreduce(net: Network, n: int, nbytes: float) -> Cost:
    """Reduce-scatter then allgather around a ring: ``2(n-1)`` phases, each rank sending
    ``nbytes/n`` to its successor (``2(n-1)/n * nbytes`` per rank each way)."""
    if n < 2 or nbytes <= 0:
        return Cost(0.0, [0.0] * net.endpoints(n), [0.0] * net.endpoints(n))
    one = phase(net, n, ((i, (i + 1) % n, nbytes / n) for i in range(n)))
    return Cost().add(one, 2 * (n - 1))


def recursive_doubling_allreduce(net: Network, n: int, nbytes: float) -> Cost:
    """``ceil(log2 n)`` phases, rank i exchanging the whole vector with ``i xor 2^j`` (Open MPI's
    choice for small messages; a partner beyond ``n`` is skipped, an approximation for n not a
    power of two)."""
    out = Cost(0.0, [0.0] * net.endpoints(n), [0.0] * net.endpoints(n))
    for j in range(math.ceil(math.log2(n)) if n > 1 else 0):
        out.add(phase(net, n, ((i, i ^ (1 << j), nbytes) for i in range(n)
                               if (i ^ (1 << j)) < n)))
    return out


def rabenseifner_allreduce(net: Network, n: int, nbytes: float) -> Cost:
    """Reduce-scatter by recursive halving, allgather by recursive doubling: ``2 log2 n``
    phases, the ring's ``2(n-1)/n`` volume (for n a power of two)."""
    out = Cost(0.0, [0.0] * net.endpoints(n), [0.0] * net.endpoints(n))
    steps = math.ceil(math.log2(n)) if n > 1 else 0
    sizes = [nbytes / 2 ** (j + 1) for j in range(steps)]
    for j, size in list(enumerate(sizes)) + list(reversed(list(enumerate(sizes)))):
        out.add(phase(net, n, ((i, i ^ (1 << j), size) for i in range(n)
                               if (i ^ (1 << j)) < n)))
    return out


ALLREDUCE: Dict[str, Callable[[Network, int, float], Cost]] = {
    "ring": ring_allreduce, "recursive_doubling": recursive_doubling_allreduce,
    "rabenseifner": rabenseifner_allreduce}


# --- allgather, gather, broadcast ----------------------------------------------------------
def ring_allgather(net: Network, n: int, each: float) -> Cost:
    """``n-1`` phases passing ``each`` bytes around the ring: every NIC receives
    ``(n-1) * each``."""
    if n < 2 or each <= 0:
        return Cost(0.0, [0.0] * net.endpoints(n), [0.0] * net.endpoints(n))
    return Cost().add(phase(net, n, ((i, (i + 1) % n, each) for i in range(n))), n - 1)


def bruck_allgather(net: Network, n: int, each: float) -> Cost:
    """Open MPI's small-message allgather (Bruck): ``ceil(log2 n)`` phases, in phase j rank i
    sends the ``min(2^j, n - 2^j)`` blocks it holds to rank ``i - 2^j``."""
    out = Cost(0.0, [0.0] * net.endpoints(n), [0.0] * net.endpoints(n))
    for j in range(math.ceil(math.log2(n)) if n > 1 else 0):
        step = 1 << j
        out.add(phase(net, n, ((i, (i - step) % n, min(step, n - step) * each)
                               for i in range(n))))
    return out


def gather(net: Network, n: int, root: int, each: float) -> Cost:
    """Every other rank sends ``each`` bytes to ``root`` at once (point-to-point, as hvd_slim's
    push): the root's ingress carries ``(n-1) * each``."""
    return phase(net, n, ((j, root, each) for j in range(n) if j != root))


def bcast_linear(net: Network, n: int, root: int, nbytes: float) -> Cost:
    """The root sends the whole message to every rank at once."""
    return phase(net, n, ((root, j, nbytes) for j in range(n) if j != root))


def _rank(vrank: int, root: int) -> int:
    # libnbc's virtual ranks: the root is vrank 0 and rank 0 takes the root's place.
    return root if vrank == 0 else (0 if vrank == root else vrank)


def bcast_binomial(net: Network, n: int, root: int, nbytes: float) -> Cost:
    """``ceil(log2 n)`` rounds; in round r every vrank below ``2^r`` that has the message sends
    it to vrank ``+ 2^r``."""
    out = Cost(0.0, [0.0] * net.endpoints(n), [0.0] * net.endpoints(n))
    for r in range(math.ceil(math.log2(n)) if n > 1 else 0):
        out.add(phase(net, n, ((_rank(v, root), _rank(v + (1 << r), root), nbytes)
                               for v in range(1 << r) if v + (1 << r) < n)))
    return out


def bcast_chain(net: Network, n: int, root: int, nbytes: float, seg: float = 32768) -> Cost:
    """A pipelined chain vrank 0 -> 1 -> ... -> n-1 in segments of ``seg`` bytes: every rank
    but the last forwards the message once. Time: the pipeline (``nseg + n - 2`` segment slots
    on the slowest link) or the load bound (a shared link carries ``(n-1) * nbytes``), whichever
    is longer, plus one overhead per segment (libnbc waits for each segment's send before the
    next) and one latency per hop."""
    ends = net.endpoints(n)
    out = Cost(0.0, [0.0] * ends, [0.0] * ends, 0)
    if n < 2 or nbytes <= 0:
        return out
    nseg = math.ceil(nbytes / seg)
    slot = 0.0
    for v in range(n - 1):
        a, b = net.endpoint(_rank(v, root)), net.endpoint(_rank(v + 1, root))
        if a != b:
            out.tx[a] += nbytes
            out.rx[b] += nbytes
            slot = max(slot, 8 * min(seg, nbytes) / min(net.rate(a), net.rate(b)))
    if net.shared:
        load = 8 * sum(out.tx) / net.rate()
    else:
        load = max((8 * max(t, r) / net.rate(h) for h, (t, r) in enumerate(zip(out.tx, out.rx))),
                   default=0.0)
    out.seconds = max((nseg + n - 2) * slot, load) + nseg * net.overhead_s + \
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
