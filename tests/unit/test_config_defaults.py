"""Defaults that the convergence study chose (docs/accuracy.md), as the config and the layout
apply them."""
from __future__ import annotations

import pytest
import torch

from hvd_slim.config import SlimConfig, default_pull_density
from hvd_slim.exchange.layout import Layout


@pytest.mark.parametrize("density, pull", [(1.0, 1.0), (0.5, 1.0), (0.1, 0.2), (0.02, 0.04),
                                           (0.01, 0.02), (0.002, 0.004), (0.001, 0.004),
                                           (1e-4, 4e-4)])
def test_default_pull_density(density, pull):
    assert default_pull_density(density) == pytest.approx(pull)
    assert SlimConfig(density=density).effective_pull_density == pytest.approx(pull)


@pytest.mark.parametrize("density, steps, start", [(0.01, 100, 0.08), (0.001, 1000, 0.05),
                                                   (0.00625, 160, 0.05), (0.005, 200, 0.05),
                                                   (1e-4, 10_000, 0.05), (0.3, 4, 1.0),
                                                   (0.125, 8, 1.0)])
def test_automatic_warmup_lasts_one_over_density_steps_from_eight_times_denser(density, steps,
                                                                                start):
    """8x the density, but never below 5% (the floor decides below 0.00625)."""
    c = SlimConfig(density=density)
    assert c.effective_warmup_decay_steps == steps and c.warmup_steps == steps
    assert c.effective_warmup_start_density == pytest.approx(start)
    first = c.densities_at(0)[0]
    assert density < first < start
    assert c.densities_at(steps - 1)[0] > density and c.densities_at(steps) is None


def test_automatic_warmup_is_off_where_it_cannot_apply():
    assert SlimConfig(density=1.0).warmup_steps == 0             # nothing to start above
    assert SlimConfig(density=0.01, warmup_decay_steps=0).warmup_steps == 0
    assert SlimConfig(density=0.01, warmup_start_density=0.01).warmup_steps == 0


def _sparse(config: SlimConfig):
    params = [("w", torch.zeros(1000, 1000))]
    return Layout(params, config, lambda dt: dt).sparse[0]


@pytest.mark.parametrize("density, ratio", [(0.02, 2), (0.01, 2), (0.001, 4)])
def test_layout_pulls_two_to_four_times_the_push(density, ratio):
    b = _sparse(SlimConfig(density=density))
    assert (b.k, b.k_pull) == (round(1e6 * density), round(ratio * 1e6 * density))
    assert b.k_pull_core + b.k_pull_explore == b.k_pull
    assert b.slice_dtype == torch.float8_e4m3fn and b.slice_bytes == 1


def test_the_default_density_and_value_bits():
    c = SlimConfig()
    assert (c.density, c.value_bits, c.momentum_masking) == (0.02, 8, 0.0)
    assert c.effective_pull_density == pytest.approx(0.04) and c.warmup_steps == 50


def test_explicit_pull_density_wins():
    assert _sparse(SlimConfig(density=0.001, pull_density=0.001)).k_pull == 1000
    assert _sparse(SlimConfig(density=0.01, pull_density=0.05)).k_pull == 50_000


def test_a_checkpoint_from_the_warmup_before_its_floor_is_refused_naming_it():
    """At density 0.001 the automatic warm-up started at 0.008 before the 5% floor: a
    checkpoint made then resumes a different schedule, so loading it names the field."""
    import hvd_slim
    from hvd_slim.transport import run_ranks

    def body(rank, tr):
        m = torch.nn.Linear(100, 100)
        opt = hvd_slim.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                            named_parameters=m.named_parameters(),
                                            density=0.001, min_compress_numel=1000,
                                            transport=tr)
        m(torch.ones(4, 100)).sum().backward()
        opt.step()
        saved = opt.state_dict()
        assert saved["hvd_slim"]["effective"]["warmup_start_density"] == pytest.approx(0.05)
        saved["hvd_slim"]["effective"]["warmup_start_density"] = 0.008   # as written before
        with pytest.raises(Exception, match="warmup_start_density"):
            opt.load_state_dict(saved)
        return True

    assert run_ranks(1, body, timeout=60) == [True]
