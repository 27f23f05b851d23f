"""``momentum_masking`` (the share of momentum correction's velocity dropped where a coordinate is
sent; 1.0 is DGC's masking). At 0, everything delivered (pulls, then a flush) is exactly dense
momentum SGD's displacement: the sum over ranks and steps of each rank's undisturbed velocity.
At 1 the velocity of every sent coordinate is dropped, so less arrives; 0.5 halves it there."""
from __future__ import annotations

import pytest
import torch

from hvd_slim.config import ConfigError, SlimConfig
from hvd_slim.config.env import resolve_config
from hvd_slim.exchange import Layout, SlimExchange
from hvd_slim.memory import ResidualMemory
from hvd_slim.transport import run_ranks

from test_exchange import SHAPES, grad_for, make_params

M, STEPS = 0.9, 6


def _delivered(size: int, masking: bool):
    return delivered(size, SlimConfig(density=0.01, min_compress_numel=1000, op="sum",
                                      momentum_masking=masking), M)


def delivered(size: int, config: SlimConfig, momentum: float, fade: float = 1.0):
    """Per rank: ``sum_t fade^(STEPS-1-t) delivered_t`` over STEPS exchange steps (momentum
    correction at ``momentum``, none at 0), plus what a flush then delivers; and the names of
    the compressed tensors."""
    def rank_fn(rank, tr):
        named = make_params()
        layout = Layout(named, config, lambda dt: dt)
        extra = {"momentum": {b.index: {"momentum": momentum} for b in layout.sparse}} \
            if momentum else {}
        ex = SlimExchange(layout, config, tr, **extra)
        got = {name: torch.zeros(p.shape, dtype=torch.float64) for name, p in named}
        for t in range(STEPS):
            for name, p in named:
                p.grad = grad_for(rank, t, name, p.shape)
            ex.step()
            for name, p in named:
                got[name] = fade * got[name] + p.grad.double()
        for _, p in named:
            p.grad = None
        ex.flush()
        for name, p in named:
            if p.grad is not None:
                got[name] += p.grad.double()
        compressed = {s.name for b in layout.sparse for s in b.segments}
        return got, compressed

    return run_ranks(size, rank_fn)


def _dense_momentum_displacement(size: int, name: str) -> torch.Tensor:
    """Sum over ranks and steps of u_t = M * u_{t-1} + g_t."""
    total = torch.zeros(SHAPES[name], dtype=torch.float64)
    for r in range(size):
        u = torch.zeros(SHAPES[name], dtype=torch.float64)
        for t in range(STEPS):
            u = M * u + grad_for(r, t, name, SHAPES[name]).double()
            total += u
    return total


@pytest.mark.parametrize("size", [2, 3])
def test_without_masking_everything_delivered_is_dense_momentums_displacement(size):
    res = _delivered(size, masking=False)
    got, compressed = res[0]
    assert compressed
    for name in compressed:
        want = _dense_momentum_displacement(size, name)
        assert torch.allclose(got[name], want, rtol=1e-5, atol=1e-4), name
    for other, _ in res[1:]:   # every replica received the same
        assert all(torch.equal(got[n], other[n]) for n in SHAPES)


def test_with_masking_the_velocity_of_sent_coordinates_is_dropped():
    got, compressed = _delivered(2, masking=True)[0]
    for name in compressed:
        want = _dense_momentum_displacement(2, name)
        lost = (want - got[name]).abs().sum() / want.abs().sum()
        assert lost > 0.01, (name, float(lost))   # a real share of the momentum never arrives


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_the_velocity_of_sent_coordinates_loses_exactly_the_masked_share(share):
    mem = ResidualMemory(8, torch.float32, torch.device("cpu"), momentum=0.9)
    a, u = mem.propose(torch.arange(1.0, 9.0))
    sent = torch.tensor([1, 4])
    mem.commit(a, u, sent, mask_velocity=share)
    expected = torch.arange(1.0, 9.0)
    expected[sent] *= 1.0 - share
    assert torch.equal(mem.velocity, expected)
    assert torch.equal(mem.residual[sent], torch.zeros(2))


def test_momentum_masking_takes_booleans_and_shares_and_refuses_the_rest():
    assert SlimConfig(momentum_masking=False).momentum_masking == 0.0
    assert SlimConfig(momentum_masking=True).momentum_masking == 1.0
    assert SlimConfig(momentum_masking=0.5).momentum_masking == 0.5
    assert resolve_config({}, {"HVD_SLIM_MOMENTUM_MASKING": "off"}).momentum_masking == 0.0
    assert resolve_config({}, {"HVD_SLIM_MOMENTUM_MASKING": "0.25"}).momentum_masking == 0.25
    with pytest.raises(ConfigError, match="momentum_masking must be in \\[0, 1\\]"):
        SlimConfig(momentum_masking=1.5)
