"""The kernels a step launches do not grow with the number of tensors (the local-work issue's
GPU target), counted on CPU tensors: every aten operator a steady ``step()`` dispatches, view
operators left out. On a GPU the memory stages the gradients into its flat buffer with one
``_foreach_copy_`` (``ResidualMemory.stage``); forced here, it must give the bits of folding
each gradient where it lies, which a CPU does. The GPU tier counts real CUDA launches."""
from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from hvd_slim.transport import FakeCluster, run_ranks
from tests.step_ops import (OPTIMIZERS, Dispatched, make_optimizer, make_params, steady,
                             take_step)


def _steady_ops(tensors: int, inner: str) -> Dict[str, int]:
    opt, ps = make_optimizer(tensors, inner, FakeCluster(1).transport(0), stage=True)
    steady(opt, ps)
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
            opt, ps = make_optimizer(12, inner, tr, stage=stage)
            for t in range(8):
                take_step(opt, ps, rank, t)
            out.append(torch.cat([p.detach().reshape(-1) for p in ps]))
        return out
    for unstaged, staged in run_ranks(2, body, timeout=120):
        assert torch.equal(unstaged, staged)


def _hook_ops(tensors: int, inner: str) -> Dict[str, int]:
    """A DDP hook's pass (one bucket holding every parameter) and the optimizer's step (under
    AdamW, the step the hook takes over) at ``tensors`` parameters: the operators of a steady
    one."""
    from hvd_slim.ddp import SlimState, slim_hook
    from tests.unit.test_ddp_state import FakeBucket

    ps = make_params(tensors)
    opt = OPTIMIZERS[inner](ps)
    state = SlimState(transport=FakeCluster(1).transport(0),
                      optimizer=opt if inner == "adamw" else None, density=0.05,
                      min_compress_numel=100)

    def one_pass(t: int) -> None:
        g = torch.Generator().manual_seed(t)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        got = slim_hook(state, FakeBucket(0, ps, True)).wait()
        offset = 0
        for p in ps:   # DDP copies the bucket back into .grad
            p.grad.copy_(got[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        opt.step()

    for t in range(state.config.warmup_steps + 2):
        one_pass(t)
    with Dispatched() as seen:
        one_pass(999)
    return dict(seen.ops)


@pytest.mark.parametrize("inner", ["sgd momentum", "adamw"])
def test_the_hooks_pass_dispatches_as_many_operators_for_90_tensors_as_for_9(inner):
    """The hook's pass, and with SlimState(optimizer=AdamW) each rank's Adam update and the
    step taken over, run as _foreach operations (what the test's own backward stand-in does
    per tensor, randn and DDP's copy back, is left out)."""
    few, many = _hook_ops(9, inner), _hook_ops(90, inner)
    ours = {op: (few.get(op, 0), n) for op, n in many.items() if n > few.get(op, 0) + 2
            and op not in ("aten.randn", "aten.copy_")}
    assert not ours, f"operators that grow with the number of tensors: {ours}"
    assert many.get("aten.copy_", 0) - few.get("aten.copy_", 0) <= 81 + 2   # DDP's copies back
    assert sum(many.values()) - many["aten.randn"] - many["aten.copy_"] <= \
        sum(few.values()) - few["aten.randn"] - few["aten.copy_"] + 20
