"""Defaults that the convergence study chose (README "Accuracy"), as the layout applies them."""
from __future__ import annotations

import pytest
import torch

from hvd_slim.config import SlimConfig, default_pull_density
from hvd_slim.exchange.layout import Layout


@pytest.mark.parametrize("density, pull", [(1.0, 1.0), (0.1, 0.1), (0.01, 0.01), (0.004, 0.004),
                                           (0.002, 0.004), (0.001, 0.004), (1e-4, 4e-4)])
def test_default_pull_density(density, pull):
    assert default_pull_density(density) == pytest.approx(pull)
    assert SlimConfig(density=density).effective_pull_density == pytest.approx(pull)


def _sparse(config: SlimConfig):
    params = [("w", torch.zeros(1000, 1000))]
    return Layout(params, config, lambda dt: dt).sparse[0]


def test_layout_pulls_four_times_the_push_at_density_0001():
    b = _sparse(SlimConfig(density=0.001))
    assert (b.k, b.k_pull) == (1000, 4000)
    assert b.k_pull_core + b.k_pull_explore == b.k_pull


def test_explicit_pull_density_wins():
    assert _sparse(SlimConfig(density=0.001, pull_density=0.001)).k_pull == 1000
    assert _sparse(SlimConfig(density=0.01, pull_density=0.05)).k_pull == 50_000
