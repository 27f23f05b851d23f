"""Defects found by reading the code (the house issue), each with the behaviour it broke."""
import os

import pytest
import torch

import hvd_slim
from hvd_slim import join_sync
from hvd_slim.config import SlimConfig
from hvd_slim.config_env import resolve_config
from hvd_slim.transport import FakeCluster, run_ranks


def test_join_digests_a_bfloat16_model_and_its_state():
    """join() compares replicas by a digest of parameters and optimizer state, which read
    them through numpy: a bfloat16 model raised TypeError on every rank."""
    m = torch.nn.Linear(8, 4).to(torch.bfloat16)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.ones(2, 8, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    a = join_sync._digest(opt)
    with torch.no_grad():
        m.weight[0, 0] += 1
    assert join_sync._digest(opt) != a


def test_a_rebuilt_optimizer_over_the_same_parameters_trains():
    """Building a second DistributedOptimizer over the same parameters (after unfreezing
    layers) left the first one's hooks alive: the next backward raised "Gradients were
    computed more than backward_passes_per_step times"."""
    def body(rank, tr):
        m = torch.nn.Linear(40, 30)
        first = hvd_slim.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                              named_parameters=m.named_parameters(),
                                              transport=tr)
        m(torch.ones(2, 40)).sum().backward()
        first.step()
        second = hvd_slim.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                               named_parameters=m.named_parameters(),
                                               transport=tr)
        for _ in range(2):
            second.zero_grad()
            m(torch.ones(2, 40)).sum().backward()
            second.step()
        return True

    assert all(run_ranks(2, body))


def test_a_replaced_config_keeps_its_sources_and_agreed_settings():
    """An elastic shrink replaced the config with dataclasses.replace, which dropped where each
    keyword came from (errors lost "(from environment variable ...)") and the settings the
    handshake compares beside the fields (the outer optimizer)."""
    cfg = resolve_config({}, {"HVD_SLIM_DENSITY": "0.05"}).agreeing(outer_optimizer="SGD")
    out = cfg.replaced(servers=1, hierarchical=False)
    assert out.env_note("density") == " (from environment variable HVD_SLIM_DENSITY)"
    assert out.shared_dict()["outer_optimizer"] == "SGD"
    assert out.digest() == cfg.digest()
