"""What a steady ``step()`` dispatches, for tests/unit/test_launches.py (aten operators, on CPU
tensors) and the GPU tier (CUDA launches): an optimizer over many tensors and its step."""
from __future__ import annotations

import collections
from typing import Any, List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hvd_slim

OPTIMIZERS = {
    "sgd momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, foreach=True),
    "sgd nesterov": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, nesterov=True,
                                               foreach=True),
    "sgd dampening": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, dampening=0.5,
                                                foreach=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01, foreach=True),
    # fused: torch's foreach AdamW reads every step count with .item() (a sync per tensor) in
    # its own step of the small tensors, which is not hvd_slim's to count
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
}


class Dispatched(TorchDispatchMode):
    """Counts the aten operators dispatched inside it, views apart (they launch nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def make_params(tensors: int, device: Any = "cpu") -> List[torch.nn.Parameter]:
    """``tensors`` seeded parameters: two in three compressed at ``min_compress_numel=100``,
    the rest small enough to be sent dense."""
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(600 if i % 3 else 40, generator=gen).to(device))
            for i in range(tensors)]


def make_optimizer(tensors: int, inner: str, transport: Any, device: Any = "cpu",
                   stage: Any = None, **kw: Any) -> Tuple[Any, List[torch.nn.Parameter]]:
    """``DistributedOptimizer`` over :func:`make_params`; ``stage``: the memory's (None: the
    device's own)."""
    ps = make_params(tensors, device)
    opt = hvd_slim.DistributedOptimizer(
        OPTIMIZERS[inner](ps), named_parameters=[(f"p{i:03d}", p) for i, p in enumerate(ps)],
        transport=transport, density=0.05, min_compress_numel=100, **kw)
    if stage is not None:
        for mem in opt._exchange.worker.memory.values():
            mem.stage = stage
    return opt, ps


def take_step(opt: Any, ps: List[torch.nn.Parameter], rank: int, t: int) -> None:
    """One step on seeded gradients (rank ``rank``, step ``t``)."""
    opt.zero_grad()
    gen = torch.Generator().manual_seed(1000 * rank + t)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen).to(p.device)
    opt.step()


def steady(opt: Any, ps: List[torch.nn.Parameter]) -> None:
    """Past the automatic warm-up, and the next step's gradients in place."""
    for t in range(opt.slim_config.warmup_steps + 2):
        take_step(opt, ps, 0, t)
    opt.zero_grad()
    for p in ps:
        p.grad = torch.ones_like(p)
