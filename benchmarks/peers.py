"""The peers run over MPI: the floor, dense ``Allreduce``, top-k + error feedback, and hvd_slim.

Every peer has the same shape (:class:`Peer`): ``module`` is what the workload backpropagates
through, ``step()`` exchanges and applies one step, and ``counters()`` returns cumulative bytes and
seconds. Byte figures say how they were obtained: "counted" means the sizes of the buffers this
rank handed a collective (or hvd_slim's transport counters); "derived" means a formula applied to
counted sizes, such as the per-rank volume of a ring allreduce.
"""
from __future__ import annotations

from typing import Any, Dict

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from hvd_slim.exchange.stats import ExchangeStats

from .models import Workload
from .topk import TopKErrorFeedback, average

# hvd_slim's per-rank phase timings (comm_stats' <phase>_seconds), reported as <phase>_s.
PHASES = ExchangeStats.PHASES

SMALL_NUMEL = 4096   # below this a tensor is averaged dense (as hvd_slim's min_compress_numel)
LR, MOMENTUM = 0.01, 0.9


def stats_counters(st: Dict[str, Any]) -> Dict[str, float]:
    """A peer's cumulative counters from hvd_slim's ``comm_stats()`` (``DistributedOptimizer``'s
    or ``SlimState``'s: the same fields), counted by hvd_slim's transport."""
    return {"handed_sent": st["bytes_pushed"], "handed_recv": st["bytes_pulled"],
            "wire_sent": st["bytes_pushed"], "wire_recv": st["bytes_pulled"],
            "select_s": st["select_seconds"], "exchange_s": st["exchange_seconds"],
            **{f"{ph}_s": st[f"{ph}_seconds"] for ph in PHASES},
            "ring_allreduce_bytes": st["ring_allreduce_bytes"],
            "dense_bytes": st["dense_bytes"], "steps": st["steps"]}


def stats_phases(st: Dict[str, Any]) -> Dict[str, float]:
    """Cumulative seconds per exchange phase from hvd_slim's ``comm_stats()``."""
    return {ph: st[f"{ph}_seconds"] for ph in PHASES}


def ring_allreduce_bytes(nbytes: float, n: int) -> float:
    """What each rank sends (and receives) in a bandwidth-optimal ring allreduce."""
    return 2.0 * (n - 1) / n * nbytes


class Peer:
    """One way of doing a data-parallel step. Subclasses fill in the exchange."""

    name = "peer"
    family = "mpi"

    def __init__(self, work: Workload, comm: Any) -> None:
        self.work, self.comm = work, comm
        self.size = comm.Get_size()
        self.module: nn.Module = work.model
        self.opt = torch.optim.SGD([p for _, p in work.named], lr=LR, momentum=MOMENTUM)
        # Cumulative figures; bytes per rank.
        self.c: Dict[str, float] = {"handed_sent": 0, "handed_recv": 0, "wire_sent": 0,
                                    "wire_recv": 0, "select_s": 0.0}
        self.basis = {"handed": "counted", "wire": "counted", "note": ""}

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self) -> None:
        self.opt.step()

    def counters(self) -> Dict[str, float]:
        return dict(self.c)

    def phases(self) -> Dict[str, float]:
        """Cumulative seconds per phase of the exchange, where the peer times them ({})."""
        return {}

    def close(self) -> None:
        """Release what the peer holds (process groups, hooks)."""


class Floor(Peer):
    """The same step with no communication at all: the limit."""

    name = "floor"

    def __init__(self, work: Workload, comm: Any) -> None:
        super().__init__(work, comm)
        self.basis = {"handed": "counted", "wire": "counted", "note": "no communication"}


def _grad_or_zero(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


class DenseAllreduce(Peer):
    """Dense averaging: all gradients fused into one buffer, one MPI ``Allreduce``."""

    name = "mpi-allreduce"

    def __init__(self, work: Workload, comm: Any) -> None:
        super().__init__(work, comm)
        self.params = [p for _, p in work.named]
        self.buf = torch.zeros(sum(p.numel() for p in self.params))
        self.basis["wire"] = "derived"
        self.basis["note"] = ("handed: bytes of the buffer given to MPI_Allreduce; wire: ring "
                              "allreduce 2(N-1)/N x handed")

    def step(self) -> None:
        torch.cat([_grad_or_zero(p).reshape(-1) for p in self.params], out=self.buf)
        arr = self.buf.numpy()
        self.comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.SUM)
        self.buf.div_(self.size)
        off = 0
        for p in self.params:
            p.grad = self.buf[off:off + p.numel()].view_as(p)
            off += p.numel()
        n = arr.nbytes
        self.c["handed_sent"] += n
        self.c["handed_recv"] += n
        self.c["wire_sent"] += ring_allreduce_bytes(n, self.size)
        self.c["wire_recv"] += ring_allreduce_bytes(n, self.size)
        self.opt.step()


class TopKAllgather(Peer):
    """DGC/GRACE-style baseline: exact ``torch.topk`` of |residual + gradient| over the large
    tensors, error feedback, and an allgather of (int32 index, fp32 value) pairs; small tensors
    are fused and allreduced dense."""

    name = "topk-ef"

    def __init__(self, work: Workload, comm: Any, density: float) -> None:
        super().__init__(work, comm)
        self.name = f"topk-ef@{density:g}"
        self.density = density
        self.big = [p for _, p in work.named if p.numel() >= SMALL_NUMEL]
        self.small = [p for _, p in work.named if p.numel() < SMALL_NUMEL]
        self.d = sum(p.numel() for p in self.big)
        self.ef = TopKErrorFeedback(self.d, density)
        self.k = self.ef.k
        self.acc = torch.zeros(self.d)
        self.small_buf = torch.zeros(sum(p.numel() for p in self.small))
        self.send = np.empty(8 * self.k, dtype=np.uint8)
        self.recv = np.empty(8 * self.k * self.size, dtype=np.uint8)
        self.basis = {"handed": "counted", "wire": "derived",
                      "note": "handed: the buffers given to MPI_Allgather (k int32 indices + k "
                              "fp32 values) and MPI_Allreduce (small tensors); wire: ring "
                              "allgather sends (N-1) x payload, ring allreduce 2(N-1)/N x bytes"}

    def step(self) -> None:
        n = self.size
        torch.cat([_grad_or_zero(p).reshape(-1) for p in self.big], out=self.acc)
        idx, vals = self.ef.compress(self.acc)
        self.c["select_s"] = self.ef.select_seconds   # the compressor keeps the running total
        self.send[:4 * self.k] = idx.to(torch.int32).numpy().view(np.uint8)
        self.send[4 * self.k:] = vals.numpy().view(np.uint8)
        self.comm.Allgather(self.send, self.recv)
        chunks = [self.recv[8 * self.k * j:8 * self.k * (j + 1)] for j in range(n)]
        total = average([torch.from_numpy(c[:4 * self.k].view(np.int32).astype(np.int64))
                         for c in chunks],
                        [torch.from_numpy(c[4 * self.k:].view(np.float32)) for c in chunks],
                        self.d, n, out=self.acc)
        off = 0
        for p in self.big:
            p.grad = total[off:off + p.numel()].view_as(p)
            off += p.numel()
        sb = 0
        if self.small:
            torch.cat([_grad_or_zero(p).reshape(-1) for p in self.small], out=self.small_buf)
            self.comm.Allreduce(MPI.IN_PLACE, self.small_buf.numpy(), op=MPI.SUM)
            self.small_buf.div_(n)
            off = 0
            for p in self.small:
                p.grad = self.small_buf[off:off + p.numel()].view_as(p)
                off += p.numel()
            sb = self.small_buf.numel() * 4
        payload = self.send.nbytes
        self.c["handed_sent"] += payload + sb
        self.c["handed_recv"] += (n - 1) * payload + sb
        self.c["wire_sent"] += (n - 1) * payload + ring_allreduce_bytes(sb, n)
        self.c["wire_recv"] += (n - 1) * payload + ring_allreduce_bytes(sb, n)
        self.opt.step()


class Slim(Peer):
    """hvd_slim's ``DistributedOptimizer`` at one density and pull mode; the mode "sharded"
    is ``pull="slim"`` with a server shard per rank (``servers=N``), "hier" is ``pull="slim"``
    with ``hierarchical=True``, "overlap" is ``pull="slim"`` with ``overlap=True`` (its stages
    start in backward, so it differs only where the workload runs a real backward), "forward"
    that with ``overlap_forward=True`` too (the stages land as the next forward reaches them:
    a step's time then includes the next forward's waits, not the end of its own exchange),
    "warm" is ``pull="slim"`` with the automatic warm-up on, as a user's run starts (every other
    mode switches it off, so its steps are steady ones; run "warm" with ``--warmup 0`` and at
    most 1/density steps to time the warm-up alone)."""

    name = "hvd_slim"
    family = "hvd_slim"

    def __init__(self, work: Workload, comm: Any, density: float, pull: str) -> None:
        super().__init__(work, comm)
        import hvd_slim
        hvd_slim.init()
        self.name = f"hvd_slim-{pull}@{density:g}"
        servers = hvd_slim.size() if pull == "sharded" else 1
        hierarchical = pull == "hier"   # the hosts' ranks combine first (local_size() > 1)
        overlap = pull in ("overlap", "forward")
        forward = pull == "forward"
        warm = pull == "warm"
        pull = "slim" if pull in ("sharded", "hier", "overlap", "forward", "warm") else pull
        self.density, self.pull = density, pull
        # The steady state is what a step costs: the automatic warm-up (denser slices for the
        # first 1/density steps of training) is switched off here, but for "warm".
        self.opt = hvd_slim.DistributedOptimizer(self.opt, named_parameters=work.named,
                                                 density=density, pull=pull, servers=servers,
                                                 hierarchical=hierarchical, overlap=overlap,
                                                 overlap_forward=forward,
                                                 **({} if warm else {"warmup_decay_steps": 0}))
        self.basis = {"handed": "counted", "wire": "counted",
                      "note": "opt.comm_stats(): bytes_pushed (payload + 8-byte length word "
                              "handed to Gatherv) and bytes_pulled (received from Bcast), counted "
                              "by hvd_slim's transport; select_s is the worker's push selection"}

    def counters(self) -> Dict[str, float]:
        return stats_counters(self.opt.comm_stats())

    def phases(self) -> Dict[str, float]:
        return stats_phases(self.opt.comm_stats())

    def extra(self) -> Dict[str, Any]:
        """The closed-form inputs and the last step's byte breakdown, for checking."""
        st = self.opt.comm_stats()
        return {"last_step": st["last_step"], "compressed_numel": st["compressed_numel"],
                "dense_numel": st["dense_numel"], "world_size": st["world_size"]}
