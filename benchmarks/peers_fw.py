"""Peers from other frameworks: torch DDP over Gloo with its comm hooks, and Horovod.

DDP's hooks all call ``torch.distributed.all_reduce``; wrapping that function counts the exact
buffers each hook hands Gloo (fp16 halves, PowerSGD's P and Q and its uncompressed tensors).
Horovod's C++ core is not instrumented: its bytes are derived from the gradient shapes.
"""
from __future__ import annotations

import os
from typing import Any, Dict

import torch
import torch.distributed as dist

from .models import Workload
from .peers import Peer, ring_allreduce_bytes, stats_counters, stats_phases
from .report import local_steps

_counted = {"bytes": 0, "calls": 0}
_original_all_reduce = dist.all_reduce


def _counting_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    _counted["bytes"] += tensor.numel() * tensor.element_size()
    _counted["calls"] += 1
    return _original_all_reduce(tensor, *args, **kwargs)


def ensure_gloo(rank: int, size: int) -> None:
    """One Gloo process group per job: over 127.0.0.1 in a shared namespace (the shaped lo), or
    on a switched cluster over eth0 with the store at host 0 (``HVDSLIM_BENCH_ADDR``)."""
    if dist.is_initialized():
        return
    port = int(os.environ.get("HVDSLIM_BENCH_PORT", "29533"))
    addr = os.environ.get("HVDSLIM_BENCH_ADDR", "127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=size)


class Ddp(Peer):
    """``DistributedDataParallel`` with ``allreduce_hook``, ``fp16_compress_hook``,
    ``powerSGD_hook`` (rank r) or hvd_slim's ``slim_hook`` ("slim": its defaults, the automatic
    warm-up off so every measured step is a steady one, as the hvd_slim peers; "slim-1b": the
    same with every parameter in one bucket, as PowerSGD's runs here; "slim-1bv": that with
    ``gradient_as_bucket_view=True``, DDP's gradients the bucket itself, so neither DDP's copy
    into the bucket nor its copy back is made; "localH": rounds of H local steps,
    ``hvd_slim.ddp.local_optimizer`` at its defaults, the warm-up off)."""

    family = "ddp"

    def __init__(self, work: Workload, comm: Any, hook: str, warmup: int) -> None:
        super().__init__(work, comm)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        from torch.nn.parallel import DistributedDataParallel as DDP
        ensure_gloo(comm.Get_rank(), self.size)
        self.name = f"ddp-{hook}"
        # hvd_slim's hook or optimizer: their counters
        self.slim = hook in ("slim", "slim-1b", "slim-1bv") or hook.startswith("local")
        nbytes = sum(p.numel() * p.element_size() for _, p in work.named)
        kwargs: Dict[str, Any] = {}
        if hook.startswith("powersgd") or hook.startswith("slim-1b"):
            # Measured: PowerSGD over Gloo at 4 ranks fails with "Received data size doesn't match
            # expected size" unless every parameter sits in one bucket; "slim-1b" is slim_hook
            # in the same single bucket, to compare like with like.
            kwargs["bucket_cap_mb"] = nbytes / 2 ** 20 + 1
        if hook == "slim-1bv":
            kwargs["gradient_as_bucket_view"] = True
        self.module = DDP(work.model, **kwargs)
        if hook == "allreduce":
            self.module.register_comm_hook(None, default_hooks.allreduce_hook)
        elif hook == "fp16":
            self.module.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif hook.startswith("local"):
            from hvd_slim.ddp import local_optimizer
            self.opt = self.state = local_optimizer(self.module, self.opt,
                                                    local_steps=local_steps(self.name, {}),
                                                    warmup_decay_steps=0)
        elif self.slim:
            from hvd_slim.ddp import SlimState, slim_hook
            self.state = SlimState(warmup_decay_steps=0)
            self.module.register_comm_hook(self.state, slim_hook)
        elif hook.startswith("powersgd-r"):
            # Vanilla allreduce runs until start_powerSGD_iter, which must cover DDP's bucket
            # rebuild at iteration 1; the worker adds extra warm-up steps after it (see
            # ``extra_warmup``), so every measured step is a steady-state PowerSGD step.
            self.state = psgd.PowerSGDState(process_group=None,
                                            matrix_approximation_rank=int(hook[len("powersgd-r"):]),
                                            start_powerSGD_iter=max(2, warmup),
                                            use_error_feedback=True, warm_start=True)
            self.module.register_comm_hook(self.state, psgd.powerSGD_hook)
        else:
            raise ValueError(f"unknown DDP hook {hook!r}")
        self.extra_warmup = 2 if hook.startswith("powersgd") else 0
        dist.all_reduce = _counting_all_reduce
        self._base = dict(_counted)
        self.basis = {"handed": "counted", "wire": "counted",
                      "note": "SlimState.comm_stats(): bytes pushed and pulled, counted by "
                              "hvd_slim's transport"} if self.slim else \
            {"handed": "counted", "wire": "derived",
             "note": "handed: bytes of every tensor the hook passed to "
                     "torch.distributed.all_reduce (Gloo); wire: ring allreduce 2(N-1)/N x handed"}

    def counters(self) -> Dict[str, float]:
        if self.slim:
            return stats_counters(self.state.comm_stats())
        handed = _counted["bytes"] - self._base["bytes"]
        wire = ring_allreduce_bytes(handed, self.size)
        return {"handed_sent": handed, "handed_recv": handed, "wire_sent": wire,
                "wire_recv": wire, "select_s": 0.0,
                "allreduce_calls": _counted["calls"] - self._base["calls"]}

    def phases(self) -> Dict[str, float]:
        return stats_phases(self.state.comm_stats()) if self.slim else {}

    def close(self) -> None:
        dist.all_reduce = _original_all_reduce


class Horovod(Peer):
    """``horovod.torch.DistributedOptimizer`` with ``Compression.none`` or ``Compression.fp16``."""

    family = "horovod"

    def __init__(self, work: Workload, comm: Any, fp16: bool) -> None:
        super().__init__(work, comm)
        import horovod.torch as hvd
        hvd.init()
        self.name = "horovod-fp16" if fp16 else "horovod"
        comp = hvd.Compression.fp16 if fp16 else hvd.Compression.none
        self.opt = hvd.DistributedOptimizer(self.opt, named_parameters=work.named,
                                            compression=comp)
        hvd.broadcast_parameters(dict(work.named), root_rank=0)
        self.bytes_per_step = sum(p.numel() for _, p in work.named) * (2 if fp16 else 4)
        self.steps = 0
        self.basis = {"handed": "derived", "wire": "derived",
                      "note": "Horovod's C++ core is not instrumented: handed = gradient numel x "
                              "(2 for fp16, else 4) per step; wire: ring allreduce 2(N-1)/N x "
                              "handed"}

    def step(self) -> None:
        self.opt.step()
        self.steps += 1

    def counters(self) -> Dict[str, float]:
        handed = self.steps * self.bytes_per_step
        wire = ring_allreduce_bytes(handed, self.size)
        return {"handed_sent": handed, "handed_recv": handed, "wire_sent": wire,
                "wire_recv": wire, "select_s": 0.0}
