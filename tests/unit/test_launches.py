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
from tests.step_ops import OPTIMIZERS, Dispatched, make_optimizer, steady, take_step


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
