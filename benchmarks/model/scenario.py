"""What every strategy's prediction is made of: the inputs (:class:`Scenario`, its
:class:`LocalCosts`), the output (:class:`Prediction`), the counted streaming passes
(:data:`PASSES`) and the collectives a strategy calls, by library.

* MPI (``mpi-allreduce``, ``horovod*``, top-k, hvd_slim's sharded exchange): ``Scenario.mpi``.
  ``ideal`` (the default, and the extrapolation's): a full-duplex MPI whose allreduce is
  ``Scenario.allreduce`` (``ring``, the dense baseline; ``rabenseifner``;
  ``recursive_doubling``) and whose allgather is a ring. ``openmpi-tcp``: Open MPI 4.1 as the
  benchmark runs it, its own choice of algorithm over its TCP BTL, where a pair's exchange of
  a large message runs one direction after the other (:mod:`.openmpi`; validate uses it).
* Gloo (DDP, PowerSGD): a ring, whatever the MPI setting (Gloo's allreduce algorithm; each rank
  sends to one neighbour and receives from the other on separate connections).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import net as nw
from . import openmpi
from .slim import SlimSettings
from .workloads import Shape, numel

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

Collective = Callable[[nw.Network, int, float], nw.Cost]
ALLREDUCE: Dict[str, Collective] = {
    "ring": nw.ring_allreduce, "recursive_doubling": nw.recursive_doubling_allreduce,
    "rabenseifner": nw.rabenseifner_allreduce}
MPI_KINDS = ("ideal", "openmpi-tcp")


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
    allreduce: str = "ring"           # an ideal MPI's allreduce: a key of ALLREDUCE
    mpi: str = "ideal"                # one of MPI_KINDS (see the module docstring)
    bcast: str = "libnbc"             # hvd_slim's pull: see bcast.bcast
    cores: int = 0                    # the machine's cores for all ranks; 0: one per rank
    # A real backward's measured profile (benchmarks.ready): (seconds from the step's start
    # to the gradient's readiness, elements) per tensor, and when backward() returned. Empty:
    # every gradient is ready at once, after the compute (the synthetic workloads).
    ready: Tuple[Tuple[float, int], ...] = ()
    backward_end_s: float = 0.0
    # hvd_slim's measured push readiness (.push_queue): per step, every rank's seconds from the
    # exchange's start to its push. Empty: every rank pushes at once (net.gather).
    push_ready: Tuple[Tuple[float, ...], ...] = ()

    @property
    def skewed(self) -> bool:
        """Whether the ranks outnumber the cores (MPI partners then enter steps apart)."""
        return 0 < self.cores < self.ranks

    @property
    def d(self) -> int:
        return numel(self.shapes)

    def __post_init__(self) -> None:
        if self.cores < 0:
            raise ValueError(f"cores must be >= 0, got {self.cores}")
        if self.mpi not in MPI_KINDS or self.allreduce not in ALLREDUCE:
            raise ValueError(f"mpi must be one of {MPI_KINDS} and allreduce one of "
                             f"{sorted(ALLREDUCE)}, got {self.mpi!r}, {self.allreduce!r}")


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


def finish(peer: str, sc: Scenario, local: float, comm: nw.Cost, sent: float, recv: float,
           **detail: Any) -> Prediction:
    ends = sc.net.endpoints(sc.ranks)
    comm.tx += [0.0] * (ends - len(comm.tx))
    comm.rx += [0.0] * (ends - len(comm.rx))
    return Prediction(peer, sc.compute_s + local + comm.seconds, sc.compute_s, local,
                      comm.seconds, comm.tx, comm.rx, sent, recv, dict(detail))


def allreduce(sc: Scenario, nbytes: float, cap: float = math.inf, gloo: bool = False
              ) -> nw.Cost:
    """One allreduce per ``cap`` bytes (DDP's buckets, Horovod's fusion buffer), by Gloo's
    ring or by MPI's algorithm (``sc.mpi``, ``sc.allreduce``)."""
    out = nw.Cost()
    left = float(nbytes)
    if gloo or sc.mpi != "openmpi-tcp":
        fn = nw.ring_allreduce if gloo else ALLREDUCE[sc.allreduce]
    else:
        def fn(net: nw.Network, n: int, nbytes: float) -> nw.Cost:
            return openmpi.allreduce(net, n, nbytes, sc.skewed)
    while left > 0:
        out.add(fn(sc.net, sc.ranks, min(cap, left)))
        left -= cap
    return out


def allgather(sc: Scenario, each: float) -> nw.Cost:
    """MPI's allgather of ``each`` bytes a rank: Open MPI's (``sc.mpi``) or a ring."""
    if sc.mpi == "openmpi-tcp":
        return openmpi.allgather(sc.net, sc.ranks, each, sc.skewed)
    return nw.ring_allgather(sc.net, sc.ranks, each)


def serialized(sc: Scenario, nbytes: float) -> bool:
    """Whether MPI runs a pair's two directions of ``nbytes`` messages one after the other."""
    return sc.mpi == "openmpi-tcp" and nbytes > openmpi.SERIAL_ABOVE


def ring_bytes(nbytes: float, n: int) -> float:
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0
