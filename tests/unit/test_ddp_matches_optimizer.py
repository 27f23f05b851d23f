"""The hook is ``DistributedOptimizer``: with every parameter in one bucket, in the order the
optimizer's layout gives them (by name), the same gradients on every rank give bitwise the same
parameters through ``SlimState`` as through ``DistributedOptimizer``, under AdamW (each rank's
update travels) and under SGD with momentum (gradients travel), through the automatic warm-up
into steady slicing, exploration included. What differs between the two in a DDP run is DDP's
bucketing (one exchange per bucket), not the arithmetic."""
from __future__ import annotations

import pytest
import torch

import hvd_slim
from hvd_slim.ddp import SlimState
from hvd_slim.transport import run_ranks

from hvd_slim.ddp import slim_hook

from test_ddp_state import SHAPES, FakeBucket, grads

NAMES = [n for n, _ in SHAPES]
ORDER = sorted(range(len(SHAPES)), key=lambda j: NAMES[j])   # the optimizer's layout: by name
_GEN = torch.Generator().manual_seed(3)
_INIT = [torch.randn(s, generator=_GEN) * 0.1 for _, s in SHAPES]


def params():
    return [torch.nn.Parameter(x.clone()) for x in _INIT]


def opt_of(ps, adam):
    return torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1) if adam else \
        torch.optim.SGD(ps, lr=0.1, momentum=0.9)


def through_optimizer(size, steps, adam, kw):
    def body(rank, tr):
        ps = params()
        opt = hvd_slim.DistributedOptimizer(opt_of(ps, adam), named_parameters=list(
            zip(NAMES, ps)), transport=tr, **kw)
        for t in range(steps):
            for p, g in zip(ps, grads(rank, t)):
                p.grad = g.clone()
            opt.step()
        return [p.detach().clone() for p in ps], opt.comm_stats()
    return run_ranks(size, body, timeout=60)


def through_hook(size, steps, adam, kw, order=ORDER, named=False):
    """The hook, every parameter in one bucket in ``order``; ``named``: the state is given the
    parameters' names (``named_parameters=``)."""
    def body(rank, tr):
        ps = params()
        opt = opt_of(ps, adam)
        state = SlimState(transport=tr, optimizer=opt if adam else None,
                          named_parameters=zip(NAMES, ps) if named else None, **kw)
        for t in range(steps):
            for p, g in zip(ps, grads(rank, t)):
                p.grad = g.clone()
            bucket = FakeBucket(0, [ps[j] for j in order], True)
            got = slim_hook(state, bucket).wait()
            offset = 0
            for j in order:   # DDP writes the future's value back into .grad
                n = ps[j].numel()
                ps[j].grad = got[offset:offset + n].view_as(ps[j]).clone()
                offset += n
            opt.step()
        return [p.detach().clone() for p in ps], state.comm_stats()
    return run_ranks(size, body, timeout=60)


@pytest.mark.parametrize("adam", [True, False], ids=["adamw", "sgd"])
def test_the_hook_in_one_bucket_steps_as_distributed_optimizer(adam):
    # 40 steps at density 0.05: the 20-step automatic warm-up, then 20 steady steps.
    kw = dict(density=0.05) if adam else dict(density=0.05, momentum_correction=False)
    optimizer, hook = through_optimizer(3, 40, adam, kw), through_hook(3, 40, adam, kw)
    for r in range(3):
        (a, a_stats), (b, b_stats) = optimizer[r], hook[r]
        assert any(not torch.equal(x, x0) for x, x0 in zip(a, _INIT))
        for j, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), (r, NAMES[j], (x - y).abs().max().item())
        # Sliced, and the same bytes each way.
        assert 0 < b_stats["bytes_pushed"] < b_stats["dense_bytes"] / 4
        assert b_stats["bytes_pushed"] == a_stats["bytes_pushed"]


def test_named_parameters_lay_a_bucket_in_another_order_out_as_distributed_optimizer():
    """DDP's buckets hold the parameters about in reverse: given their names (as a framework
    that registers the hook itself needs), the exchange lays the bucket out by name, and the
    hook steps bit for bit as DistributedOptimizer; by position it does not."""
    kw = dict(density=0.05)
    reverse = ORDER[::-1]
    assert reverse != ORDER
    optimizer = through_optimizer(3, 30, True, kw)
    named = through_hook(3, 30, True, kw, order=reverse, named=True)
    unnamed = through_hook(3, 30, True, kw, order=reverse)
    for r in range(3):
        for x, y in zip(optimizer[r][0], named[r][0]):
            assert torch.equal(x, y)
        assert not all(torch.equal(x, y) for x, y in zip(optimizer[r][0], unnamed[r][0]))
