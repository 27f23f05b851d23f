"""The density warm-up (warmup_dense_steps, warmup_decay_steps): dense steps are exactly dense
momentum SGD, the decay shrinks every message step by step down to the regular slice, and
nothing is lost or diverges between replicas on the way."""
from __future__ import annotations

import pytest
import torch

import hvd_slim
from hvd_slim.config import ConfigError, SlimConfig
from hvd_slim.config.env import resolve_config
from hvd_slim.exchange import Layout, SlimExchange
from hvd_slim.transport import run_ranks

from test_exchange import (SHAPES, assert_resumes_identically, grad_for, make_params,
                           simulate, total)

WARM = dict(warmup_dense_steps=2, warmup_decay_steps=4, warmup_start_density=1.0)


def test_schedule_is_dense_then_geometric_down_to_the_targets():
    c = SlimConfig(density=0.01, pull_density=0.04, **WARM)
    assert [c.densities_at(t) for t in (0, 1)] == [(1.0, 1.0), (1.0, 1.0)]
    pushes = [c.densities_at(t)[0] for t in range(2, 6)]
    assert pushes == pytest.approx([0.01 ** (i / 5) for i in range(1, 5)])
    pulls = [c.densities_at(t)[1] for t in range(2, 6)]
    assert pulls == pytest.approx([0.04 ** (i / 5) for i in range(1, 5)])
    assert all(c.densities_at(t)[1] >= c.densities_at(t)[0] for t in range(6))
    assert c.densities_at(6) is None and c.warmup_steps == 6
    assert SlimConfig(warmup_decay_steps=0).densities_at(0) is None


def test_decay_from_a_start_density_keeps_the_pull_ratio():
    c = SlimConfig(density=0.01, pull_density=0.03, warmup_decay_steps=9,
                   warmup_start_density=0.1)
    for t in range(9):
        push, pull = c.densities_at(t)
        assert push == pytest.approx(0.1 * 0.1 ** ((t + 1) / 10))
        assert pull == pytest.approx(3 * push)
    assert c.densities_at(9) is None


def test_bad_warmup_settings_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match="warmup_decay_steps must be >= 0"):
        SlimConfig(warmup_decay_steps=-1)
    with pytest.raises(ConfigError, match="warmup_start_density .* must not be below density"):
        SlimConfig(density=0.01, warmup_start_density=0.005)
    with pytest.raises(ConfigError, match=r"warmup_start_density must be in \(0, 1\]"):
        SlimConfig(warmup_start_density=1.5)
    with pytest.raises(ConfigError, match="HVD_SLIM_WARMUP_START_DENSITY"):
        resolve_config({}, {"HVD_SLIM_WARMUP_START_DENSITY": "lots"})
    assert resolve_config({}, {"HVD_SLIM_WARMUP_DECAY_STEPS": "auto",
                               "HVD_SLIM_WARMUP_START_DENSITY": "0.5"}).warmup_start_density == 0.5
    with pytest.raises(ConfigError, match="HVD_SLIM_WARMUP_DENSE_STEPS"):
        resolve_config({}, {"HVD_SLIM_WARMUP_DENSE_STEPS": "2.5"})
    assert resolve_config({}, {"HVD_SLIM_WARMUP_DENSE_STEPS": "100"}).warmup_dense_steps == 100


def _build() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(40, 60), torch.nn.Tanh(), torch.nn.Linear(60, 3))


torch.manual_seed(0)
_INIT = _build().state_dict()   # made once: simulated ranks are threads sharing the global RNG


def _mlp() -> torch.nn.Module:
    m = _build()
    m.load_state_dict(_INIT)
    return m


def _batch(rank: int, t: int):
    g = torch.Generator().manual_seed(100 * rank + t)
    return torch.randn(16, 40, generator=g), torch.randint(0, 3, (16,), generator=g)


@pytest.mark.parametrize("size", [2, 3])
def test_dense_warmup_steps_are_dense_momentum_sgd(size):
    """The dense steps run momentum SGD on the exact average gradient (the velocity lives in
    hvd_slim, momentum correction): the same parameters as a single-process reference."""
    steps = 4

    def body(rank, tr):
        m = _mlp()
        opt = hvd_slim.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
            named_parameters=m.named_parameters(), transport=tr, density=0.01,
            min_compress_numel=1000, warmup_dense_steps=steps)
        for t in range(steps):
            opt.zero_grad()
            x, y = _batch(rank, t)
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in m.parameters()], opt.comm_stats()

    got = run_ranks(size, body)
    ref = _mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for t in range(steps):
        opt.zero_grad()
        for r in range(size):
            x, y = _batch(r, t)
            (torch.nn.functional.cross_entropy(ref(x), y) / size).backward()
        opt.step()
    for r in range(size):
        for a, b in zip(got[r][0], ref.parameters()):
            assert torch.allclose(a, b.detach(), rtol=1e-5, atol=1e-6)
    # Dense steps move whole buckets: far more than the 1% slice would.
    stats = got[1][1]
    assert stats["bytes_pushed"] > 0.5 * stats["dense_bytes"]


@pytest.mark.parametrize("pull", ["slim", "union"])
def test_decay_shrinks_messages_to_the_regular_slice_and_conserves_everything(pull):
    size, steps = 3, 9
    res = simulate(size, steps, flush=True, op="sum", density=0.01, pull=pull, seed=2, **WARM)
    # Identity on every step, and flush delivers everything fed in (nothing lost at the
    # switches between dense, decaying and regular steps).
    for t in range(steps):
        for name in SHAPES:
            assert torch.equal(res[0][0][t][name], res[2][0][t][name]), (t, name)
    fed = total(d for rank in res for d in rank[1])
    delivered = total(res[0][0] + [res[0][3]])
    for name in SHAPES:
        assert torch.allclose(delivered[name], fed[name], rtol=1e-5, atol=1e-4), name
    # Coordinates each step's pull updated: all of them twice, then strictly fewer each step,
    # then at most what a run without warm-up may update (the regular pull slice).
    nonzero = [sum(int((res[0][0][t][n] != 0).sum()) for n in SHAPES) for t in range(steps)]
    layout = res[0][2].layout
    union = pull == "union"
    regular = sum(b.numel if b.kind == "dense" else (size * b.k if union else b.k_pull)
                  for b in layout.buckets)
    assert nonzero[0] == nonzero[1] == sum(b.numel for b in layout.buckets)
    assert all(a > b for a, b in zip(nonzero[1:6], nonzero[2:7])), nonzero
    assert nonzero[5] > regular >= max(nonzero[6:]), (nonzero, regular)


def test_dense_warmup_step_leaves_no_residual_and_keeps_the_velocity():
    config = SlimConfig(density=0.01, min_compress_numel=1000, warmup_dense_steps=1)

    def rank_fn(rank, tr):
        named = make_params()
        mom = {b.index: {"momentum": 0.9} for b in Layout(named, config, lambda d: d).sparse}
        ex = SlimExchange(Layout(named, config, lambda d: d), config, tr, momentum=mom)
        for name, p in named:
            p.grad = grad_for(rank, 0, name, p.shape)
        ex.step()
        (b,) = ex.layout.sparse
        return ex.residual_norm(), float(ex.worker.memory[b.index].velocity.abs().sum())

    for residual, velocity in run_ranks(2, rank_fn):
        assert residual == 0.0 and velocity > 0.0


def test_checkpoint_in_the_middle_of_the_decay_resumes_identically():
    assert_resumes_identically(SlimConfig(density=0.02, min_compress_numel=1000, seed=5,
                                          **WARM), size=2, split=4)
