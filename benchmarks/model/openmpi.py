"""Open MPI 4.1's own allreduce and allgather, as the benchmark's MPI peers run them over its TCP
BTL (``--mca btl tcp,self``): ``mpi-allreduce`` and ``horovod*`` (``MPI_Allreduce``), top-k
(``MPI_Allgather``, and ``MPI_Allreduce`` of its small tensors).

**Which algorithm.** The tuned component's fixed decision rules
(ompi/mca/coll/tuned/coll_tuned_decision_fixed.c, v4.1.4, the benchmark's ``mpirun``), here as
tables of (communicator size bound, [(message size bound, algorithm)]). Every allreduce the
benchmark measures (2 to 8 ranks, 4.6 to 47 MB) is Rabenseifner's (reduce-scatter by recursive
halving, allgather by recursive doubling), not a ring. The NIC counters say so: with two hosts
of two ranks its halving steps pair ranks of one host first, so each NIC carries ``B`` each way
(4.84 MB measured for cnn1m's 4.59 MB, ``hosts_cnn1m_2hx2_100m``), where a ring would put
``1.5 B`` (7.36 MB) on it. Allgathers under 32 ranks are recursive doubling (two ranks:
``two_proc``).

**Serialized exchanges.** Rabenseifner's and recursive doubling's steps are pairwise exchanges,
``ompi_coll_base_sendrecv`` with one peer: an ``irecv``, a blocking ``send``, a wait. Over the
TCP BTL one connection carries both directions of a pair, and its fragments leave in order
(the endpoint's FIFO). A message beyond ``btl_rdma_pipeline_send_length`` (128 KiB) moves its
rest as one RDMA-put fragment (``btl_rdma_pipeline_frag_size`` is 2 GiB) once the receiver has
sent its request. When the two partners do not enter the step together (the rule, not the
exception, with 4 or 8 ranks on 2 cores), the early one's own put starts before it has matched
the late one's rendezvous, and its request for the late one's data waits behind its own put on
their connection: the two directions run one after the other, ``(tx + rx) / rate`` on each NIC.
This is an upper bound (partners that enter together overlap). What decides how often the
partners enter apart is whether the ranks outnumber the cores. When they do (``skewed``, 4 or 8
ranks on 2 cores), every step is entered apart: a rank's partner is often descheduled. When
every rank has a core, only the collective's first step is (the ranks arrive from their own
local work at different times); each later step starts as both partners finish the one before,
together, and its directions overlap. Measured: the dense MPI
allreduces took 1.5-2.1x the full-duplex Rabenseifner time on the switched NICs (every file of
the cluster studies), where Gloo's ring (DDP: each rank sends to one neighbour and receives
from the other) and Open MPI's one-way transfers (hvd_slim's push and pull) reach the line rate.
With 2 ranks on the 2 cores (cnn1m at 2 hosts, 4.59 MB: two steps of 2.29 MB) the allreduce's
wire time was 1.52x the full-duplex time: the serialized first step and a full-duplex second
one (1.5x), not every step serialized (2x, which predicted +31.5%). Steps of at most 128 KiB, and a ring (``irecv`` from the left, ``send`` to the right), are not
serialized. On a shared link the order does not matter (every byte crosses it anyway).
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

from .bcast import bcast_binomial
from .net import (Cost, Flow, Network, Tokens, bruck_allgather, empty, phase, ring_allgather,
                  ring_allreduce)

# ob1 over the TCP BTL: beyond this a message's rest is one put fragment (see the docstring).
SERIAL_ABOVE = 128 * 1024
Rules = Sequence[Tuple[float, Sequence[Tuple[float, int]]]]
INF = math.inf
# allreduce, commutative op: 1 basic_linear, 2 nonoverlapping, 3 recursive_doubling, 4 ring,
# 5 segmented_ring, 6 rabenseifner.
ALLREDUCE_RULES: Rules = (
    (4, ((8, 4), (4096, 3), (8192, 4), (16384, 3), (65536, 4), (262144, 5), (INF, 6))),
    (8, ((16, 4), (8192, 3), (INF, 6))),
    (16, ((8192, 3), (INF, 6))),
    (32, ((64, 5), (4096, 3), (INF, 6))),
    (64, ((128, 5), (INF, 6))),
    (128, ((262144, 3), (INF, 6))),
    (256, ((131072, 2), (262144, 3), (INF, 6))),
    (512, ((4096, 2), (INF, 6))),
    (2048, ((2048, 2), (16384, 3), (INF, 6))),
    (4096, ((2048, 2), (4096, 5), (16384, 3), (INF, 6))),
    (INF, ((2048, 2), (16384, 5), (32768, 3), (INF, 6))))
# allgather (total = one rank's block): 1 linear, 2 bruck, 3 recursive_doubling, 4 ring,
# 5 neighbor exchange, 6 two_proc. The tables' equality test (size == 2) is the first row.
ALLGATHER_RULES: Rules = (
    (3, ((INF, 6),)),
    (32, ((INF, 3),)),
    (64, ((1024, 3), (65536, 5), (INF, 4))),
    (128, ((512, 3), (65536, 5), (INF, 4))),
    (256, ((512, 3), (131072, 5), (524288, 4), (1048576, 5), (INF, 4))),
    (512, ((32, 3), (128, 2), (1024, 3), (131072, 5), (524288, 4), (1048576, 5), (INF, 4))),
    (1024, ((64, 3), (256, 2), (2048, 3), (INF, 5))),
    (2048, ((4, 3), (8, 2), (16, 3), (32, 2), (256, 3), (512, 2), (4096, 3), (INF, 5))),
    (4096, ((32, 2), (128, 3), (512, 2), (4096, 3), (INF, 5))),
    (INF, ((2, 3), (8, 2), (16, 3), (512, 2), (4096, 3), (INF, 5))))


def decide(rules: Rules, n: int, nbytes: float) -> int:
    """The algorithm number the fixed rules pick for ``n`` ranks and ``nbytes``."""
    for size_bound, by_size in rules:
        if n < size_bound:
            for bytes_bound, alg in by_size:
                if nbytes < bytes_bound:
                    return alg
    raise AssertionError("the last rule has no bound")


def _exchange(net: Network, n: int, pairs: List[Tuple[int, int]], each: float,
              tokens: Tokens, apart: bool = True) -> Cost:
    """One step of pairwise exchanges of ``each`` bytes each way, serialized beyond
    :data:`SERIAL_ABOVE` when the partners enter it ``apart`` (see the module docstring)."""
    flows: List[Flow] = [f for a, b in pairs for f in ((a, b, each), (b, a, each))]
    return phase(net, n, flows, tokens, serial=apart and each > SERIAL_ABOVE)


def _pof2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def rabenseifner(net: Network, n: int, nbytes: float, skewed: bool = True) -> Cost:
    """``ompi_coll_base_allreduce_intra_redscat_allgather``: for n not a power of two, the first
    ``2r`` ranks (r = n - 2^floor(log2 n)) exchange halves in pairs and the odd ones hand their
    reduced half to the even ones, which take part for both; recursive halving then doubling
    among the 2^floor(log2 n) left; the even ranks send the result to their odd partners.
    ``skewed``: every step's partners enter it apart, else only the first's."""
    out, tokens = empty(net, n), Tokens(net, n)
    if n < 2 or nbytes <= 0:
        return out
    p = _pof2(n)
    r = n - p
    if r:
        out.add(_exchange(net, n, [(2 * i, 2 * i + 1) for i in range(r)], nbytes / 2, tokens))
        out.add(phase(net, n, [(2 * i + 1, 2 * i, nbytes / 2) for i in range(r)], tokens))
    first = not r
    real = [2 * v if v < r else v + r for v in range(p)]
    steps = p.bit_length() - 1
    sizes = [nbytes / 2 ** (j + 1) for j in range(steps)]
    order = list(range(steps)) + list(reversed(range(steps)))
    for j in order:
        pairs = [(real[v], real[v ^ (1 << j)]) for v in range(p) if v < v ^ (1 << j)]
        out.add(_exchange(net, n, pairs, sizes[j], tokens, skewed or first))
        first = False
    if r:
        out.add(phase(net, n, [(2 * i, 2 * i + 1, nbytes) for i in range(r)], tokens))
    return out


def recursive_doubling(net: Network, n: int, nbytes: float, skewed: bool = True) -> Cost:
    """Allreduce by recursive doubling: the whole vector exchanged with ``i xor 2^j`` for
    ``log2`` of the largest power of two steps (the rest fold in and out as in
    :func:`rabenseifner`, whole vectors; ``skewed`` as there)."""
    out, tokens = empty(net, n), Tokens(net, n)
    p = _pof2(n)
    r = n - p
    if r:
        out.add(phase(net, n, [(2 * i + 1, 2 * i, nbytes) for i in range(r)], tokens))
    real = [2 * v if v < r else v + r for v in range(p)]
    for j in range(p.bit_length() - 1):
        pairs = [(real[v], real[v ^ (1 << j)]) for v in range(p) if v < v ^ (1 << j)]
        out.add(_exchange(net, n, pairs, nbytes, tokens, skewed or (j == 0 and not r)))
    if r:
        out.add(phase(net, n, [(2 * i, 2 * i + 1, nbytes) for i in range(r)], tokens))
    return out


def reduce_bcast(net: Network, n: int, nbytes: float) -> Cost:
    """Algorithms 1 and 2 (a reduce to rank 0, then a broadcast), taken as two binomial trees:
    the rules pick them only for small messages on 128 ranks or more."""
    return bcast_binomial(net, n, 0, nbytes).add(bcast_binomial(net, n, 0, nbytes))


def allreduce(net: Network, n: int, nbytes: float, skewed: bool = True) -> Cost:
    """``MPI_Allreduce`` of ``nbytes`` as Open MPI 4.1's tuned component runs it; ``skewed``:
    the ranks outnumber the cores (see the module docstring)."""
    if n < 2 or nbytes <= 0:
        return empty(net, n)
    alg = decide(ALLREDUCE_RULES, n, nbytes)
    if alg == 6 and nbytes >= _pof2(n):
        return rabenseifner(net, n, nbytes, skewed)
    if alg == 3:
        return recursive_doubling(net, n, nbytes, skewed)
    if alg in (4, 5):
        return ring_allreduce(net, n, nbytes)
    return reduce_bcast(net, n, nbytes)


def allgather(net: Network, n: int, each: float, skewed: bool = True) -> Cost:
    """``MPI_Allgather`` of ``each`` bytes a rank as Open MPI 4.1's tuned component runs it:
    two_proc (one exchange), recursive doubling (exchanges of 1, 2, 4 ... blocks; Bruck's when n
    is not a power of two, as the code falls back), neighbor exchange (n/2 steps: first one
    block, then two, with alternating neighbours), the ring, or Bruck's. ``skewed`` as for
    :func:`allreduce`."""
    if n < 2 or each <= 0:
        return empty(net, n)
    alg = decide(ALLGATHER_RULES, n, each)
    tokens = Tokens(net, n)
    if alg == 6:
        return _exchange(net, n, [(0, 1)], each, tokens)
    if alg == 3 and n == _pof2(n):
        out = empty(net, n)
        for j in range(n.bit_length() - 1):
            pairs = [(i, i ^ (1 << j)) for i in range(n) if i < i ^ (1 << j)]
            out.add(_exchange(net, n, pairs, each * (1 << j), tokens, skewed or j == 0))
        return out
    if alg == 5 and n % 2 == 0:
        out = empty(net, n)
        for k in range(n // 2):   # even steps pair (0, 1), (2, 3) ..., odd ones (1, 2) ...
            pairs = [(i, (i + 1) % n) for i in range(k % 2, n, 2)]
            out.add(_exchange(net, n, pairs, each * (1 if k == 0 else 2), tokens,
                              skewed or k == 0))
        return out
    if alg == 4:
        return ring_allgather(net, n, each)
    return bruck_allgather(net, n, each)
