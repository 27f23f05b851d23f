"""The kernels a step launches do not grow with the number of tensors (the local-work issue's
GPU target), counted on CPU tensors: every aten operator a steady ``step()`` dispatches, view
operators left out (they launch nothing). On a GPU the memory stages the gradients into its
flat buffer with one ``_foreach_copy_`` (``ResidualMemory.stage``); forced here, it must give
the bits of folding each gradient where it lies, which a CPU does."""
from __future__ import annotations

import collections
from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hvd_slim
from hvd_slim.transport import FakeCluster, run_ranks


class Dispatched(TorchDispatchMode):
    """Counts the aten operators dispatched inside it, views apart."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


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


def _optimizer(tensors: int, inner: str, tr: Any, stage: bool, **kw: Any
               ) -> Tuple[Any, List[torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(0)
    # compressed tensors, and small ones sent dense (a dense bucket: its copies are counted too)
    ps = [torch.nn.Parameter(torch.randn(600 if i % 3 else 40, generator=gen))
          for i in range(tensors)]
    opt = hvd_slim.DistributedOptimizer(
        OPTIMIZERS[inner](ps), named_parameters=[(f"p{i:03d}", p) for i, p in enumerate(ps)],
        transport=tr, density=0.05, min_compress_numel=100, **kw)
    for mem in opt._exchange.worker.memory.values():
        mem.stage = stage
    return opt, ps


def _step(opt: Any, ps: List[torch.nn.Parameter], rank: int, t: int) -> None:
    opt.zero_grad()
    gen = torch.Generator().manual_seed(1000 * rank + t)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()


def _steady_ops(tensors: int, inner: str) -> Dict[str, int]:
    opt, ps = _optimizer(tensors, inner, FakeCluster(1).transport(0), stage=True)
    steady = opt.slim_config.warmup_steps + 2
    for t in range(steady):
        _step(opt, ps, 0, t)
    opt.zero_grad()
    for p in ps:
        p.grad = torch.ones_like(p)
    with Dispatched() as seen:
        opt.step()
    return dict(seen.ops)


@pytest.mark.parametrize("inner", ["sgd momentum", "adamw"])
def test_a_steady_step_dispatches_as_many_operators_for_90_tensors_as_for_9(inner):
    few, many = _steady_ops(9, inner), _steady_ops(90, inner)
    grown = {op: (few.get(op, 0), n) for op, n in many.items() if n > few.get(op, 0) + 2}
    assert not grown, f"operators that grow with the number of tensors: {grown}"
    assert sum(many.values()) <= sum(few.values()) + 20


@pytest.mark.parametrize("inner", sorted(OPTIMIZERS))
def test_staging_the_gradients_gives_the_bits_of_folding_them_where_they_lie(inner):
    def body(rank: int, tr: Any) -> List[torch.Tensor]:
        out = []
        for stage in (False, True):
            opt, ps = _optimizer(12, inner, tr, stage=stage)
            for t in range(8):
                _step(opt, ps, rank, t)
            out.append(torch.cat([p.detach().reshape(-1) for p in ps]))
        return out
    for unstaged, staged in run_ranks(2, body, timeout=120):
        assert torch.equal(unstaged, staged)
