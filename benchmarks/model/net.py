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

Two refinements, each a property of what carries the bytes, not of a strategy:

* **Token buckets** (``Network.burst_bytes``). The benchmark shapes every NIC direction (and the
  shared loopback) with ``tc tbf``, whose bucket holds ``burst`` bytes (benchmarks/cluster.py's
  rule: 1 ms at the rate, at least 32 KiB). A bucket refills while its direction is idle, so a
  collective that starts after local work (longer than ``burst / rate``: 1 ms at 1 Gbit/s, 2.6 ms
  at 100 Mbit/s, 26 ms at 10 Mbit/s) sends its first ``burst`` bytes on each NIC direction at
  line speed. A collective passes one :class:`Tokens` through its phases: each NIC direction's
  bucket is spent once, by the first phase that uses it (back-to-back phases leave none). At
  1 Gbit/s it is 125 kB of tens of MB; at 10 and 100 Mbit/s it is most of a small message.
* **Serialized exchanges** (``phase(..., serial=True)``): where each rank sends to and receives
  from the same peer over a transport whose two directions do not overlap (Open MPI's TCP BTL
  for large messages, :mod:`.openmpi`), a NIC carries its transmit and its receive bytes one
  after the other: ``(tx_h + rx_h) / r_h`` instead of the maximum.

Rates are bits/s; ``efficiency`` (the achieved share of line rate, e.g. the benchmark's
pingpong over the nominal rate) scales every rate. NIC counters (``tx``/``rx`` per endpoint: a
host when switched, a rank when shared) are payload bytes times ``frame_overhead``
(Ethernet/IP/TCP framing as an interface counter sees it) plus ``ack_overhead`` times the bytes
received (the ACKs going back).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

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
    burst_bytes: Tuple[float, ...] = ()  # token bucket per host (or one for all); () none

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        rates = tuple(float(r) for r in (self.rate_bps if isinstance(self.rate_bps, Iterable)
                                         else (self.rate_bps,)))
        if not rates or min(rates) <= 0:
            raise ValueError(f"rates must be positive bits/s, got {self.rate_bps!r}")
        object.__setattr__(self, "rate_bps", rates)
        bursts = tuple(float(b) for b in (self.burst_bytes if isinstance(self.burst_bytes, Iterable)
                                          else (self.burst_bytes,)))
        if bursts and min(bursts) < 0:
            raise ValueError(f"burst_bytes must be >= 0, got {self.burst_bytes!r}")
        object.__setattr__(self, "burst_bytes", bursts)
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

    def burst(self, endpoint: int = 0) -> float:
        """Payload bytes a full token bucket lets through at line speed (the bucket counts
        frames, so its bytes over ``frame_overhead``)."""
        if not self.burst_bytes:
            return 0.0
        b = self.burst_bytes[0] if self.shared or len(self.burst_bytes) == 1 else \
            self.burst_bytes[endpoint]
        return b / self.frame_overhead

    def check(self, n: int) -> None:
        hosts = self.endpoints(n)
        if not self.shared and len(self.rate_bps) not in (1, hosts):
            raise ValueError(f"{hosts} hosts but {len(self.rate_bps)} rates: give one or one "
                             "per host")


class Tokens:
    """The token buckets one collective may still spend: full at its start, each NIC direction's
    (or the shared link's) spent by the first phase that uses it."""

    def __init__(self, net: Network, n: int) -> None:
        self.net = net
        self.left: Dict[Tuple[int, str], float] = {}
        if net.burst_bytes:
            if net.shared:
                self.left[(0, "link")] = net.burst(0)
            else:
                for h in range(net.endpoints(n)):
                    self.left[(h, "tx")] = self.left[(h, "rx")] = net.burst(h)

    def spend(self, key: Tuple[int, str], load: float) -> float:
        """``load`` bytes less what the bucket ``key`` lets through free (and empty it)."""
        free = min(load, self.left.get(key, 0.0))
        if load > 0 and key in self.left:
            self.left[key] = 0.0
        return load - free


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


def empty(net: Network, n: int) -> Cost:
    return Cost(0.0, [0.0] * net.endpoints(n), [0.0] * net.endpoints(n), 0)


def phase(net: Network, n: int, flows: Iterable[Flow], tokens: Optional[Tokens] = None,
          serial: bool = False) -> Cost:
    """One phase: ``flows`` concurrently, then one latency, and the per-message overhead once
    for every message the busiest rank handles (a rank's sends overlap its receives; the root
    of a gather or a linear broadcast handles n-1 in turn). ``tokens``: the collective's token
    buckets (see the module docstring); ``serial``: a NIC's transmit and receive bytes one after
    the other (a pairwise exchange whose directions do not overlap)."""
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
    spend = tokens.spend if tokens is not None else (lambda key, load: load)
    if net.shared:
        bw = 8 * spend((0, "link"), sum(tx)) / net.rate()
    else:
        bw = 0.0
        for h, (t, r) in enumerate(zip(tx, rx)):
            t, r = spend((h, "tx"), t), spend((h, "rx"), r)
            bw = max(bw, 8 * ((t + r) if serial else max(t, r)) / net.rate(h))
    msgs = max(max(sends.values()), max(recvs.values()))
    return Cost(bw + net.latency_s + msgs * net.overhead_s, *counters(net, tx, rx), 1)


def counters(net: Network, tx: List[float], rx: List[float]) -> Tuple[List[float], List[float]]:
    """What interface counters show for payload bytes ``tx``/``rx`` per endpoint: framing on
    the data, and the ACKs of what an endpoint receives on its transmit side."""
    f, a = net.frame_overhead, net.ack_overhead
    return ([f * t + a * r for t, r in zip(tx, rx)], [f * r + a * t for t, r in zip(tx, rx)])


def repeated(net: Network, n: int, flows: List[Flow], times: int, serial: bool = False) -> Cost:
    """``times`` identical phases back to back: the first spends the token buckets."""
    if times < 1:
        return empty(net, n)
    out = phase(net, n, flows, Tokens(net, n), serial)
    return out.add(phase(net, n, flows, None, serial), times - 1)


# --- allreduce -------------------------------------------------------------------------------
def ring_allreduce(net: Network, n: int, nbytes: float) -> Cost:
    """Reduce-scatter then allgather around a ring: ``2(n-1)`` phases, each rank sending
    ``nbytes/n`` to its successor (``2(n-1)/n * nbytes`` per rank each way). Gloo's allreduce
    (DDP, PowerSGD) and the extrapolation's dense baseline."""
    if n < 2 or nbytes <= 0:
        return empty(net, n)
    return repeated(net, n, [(i, (i + 1) % n, nbytes / n) for i in range(n)], 2 * (n - 1))


def recursive_doubling_allreduce(net: Network, n: int, nbytes: float) -> Cost:
    """``ceil(log2 n)`` phases, rank i exchanging the whole vector with ``i xor 2^j`` (a
    partner beyond ``n`` is skipped, an approximation for n not a power of two)."""
    out, tokens = empty(net, n), Tokens(net, n)
    for j in range(math.ceil(math.log2(n)) if n > 1 else 0):
        out.add(phase(net, n, ((i, i ^ (1 << j), nbytes) for i in range(n)
                               if (i ^ (1 << j)) < n), tokens))
    return out


def rabenseifner_allreduce(net: Network, n: int, nbytes: float) -> Cost:
    """Reduce-scatter by recursive halving, allgather by recursive doubling: ``2 log2 n``
    phases, the ring's ``2(n-1)/n`` volume (for n a power of two; :mod:`.openmpi` has Open
    MPI's own, with its schedule for the others)."""
    out, tokens = empty(net, n), Tokens(net, n)
    steps = math.ceil(math.log2(n)) if n > 1 else 0
    sizes = [nbytes / 2 ** (j + 1) for j in range(steps)]
    for j, size in list(enumerate(sizes)) + list(reversed(list(enumerate(sizes)))):
        out.add(phase(net, n, ((i, i ^ (1 << j), size) for i in range(n)
                               if (i ^ (1 << j)) < n), tokens))
    return out


# --- allgather, gather ---------------------------------------------------------------------
def ring_allgather(net: Network, n: int, each: float) -> Cost:
    """``n-1`` phases passing ``each`` bytes around the ring: every NIC receives
    ``(n-1) * each``."""
    if n < 2 or each <= 0:
        return empty(net, n)
    return repeated(net, n, [(i, (i + 1) % n, each) for i in range(n)], n - 1)


def bruck_allgather(net: Network, n: int, each: float) -> Cost:
    """Open MPI's small-message allgather (Bruck): ``ceil(log2 n)`` phases, in phase j rank i
    sends the ``min(2^j, n - 2^j)`` blocks it holds to rank ``i - 2^j``."""
    out, tokens = empty(net, n), Tokens(net, n)
    for j in range(math.ceil(math.log2(n)) if n > 1 else 0):
        step = 1 << j
        out.add(phase(net, n, ((i, (i - step) % n, min(step, n - step) * each)
                               for i in range(n)), tokens))
    return out


def gather(net: Network, n: int, root: int, each: float) -> Cost:
    """Every other rank sends ``each`` bytes to ``root`` at once (point-to-point, as hvd_slim's
    push): the root's ingress carries ``(n-1) * each``."""
    return phase(net, n, ((j, root, each) for j in range(n) if j != root), Tokens(net, n))
