"""Defects found by reading the code (the house issue), each with the behaviour it broke."""
import threading

import pytest
import torch

import hvd_slim
from hvd_slim.api import join as api_join
from hvd_slim.config.env import resolve_config
from hvd_slim.transport import FakeCluster, run_ranks


def test_join_digests_a_bfloat16_model_and_its_state():
    """join() compares replicas by a digest of parameters and optimizer state, which read
    them through numpy: a bfloat16 model raised TypeError on every rank."""
    m = torch.nn.Linear(8, 4).to(torch.bfloat16)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.ones(2, 8, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    a = api_join._digest(opt)
    with torch.no_grad():
        m.weight[0, 0] += 1
    assert api_join._digest(opt) != a


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


def test_rank_0_logs_the_settings_in_force_and_where_each_came_from(caplog, monkeypatch):
    import logging
    monkeypatch.setenv("HVD_SLIM_EXPLORATION", "0.2")
    m = torch.nn.Linear(80, 60)
    with caplog.at_level(logging.INFO, logger="hvd_slim"):
        hvd_slim.DistributedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3),
                                      named_parameters=m.named_parameters(),
                                      transport=FakeCluster(1).transport(0), seed=3)
    text = caplog.text
    assert "DistributedOptimizer(AdamW) over 1 ranks" in text
    assert "density=0.05 (update default)" in text and "value_bits=2 (update default)" in text
    assert "exploration=0.2 (HVD_SLIM_EXPLORATION)" in text and "seed=3 (keyword)" in text
    assert "pull='slim' (default)" in text and "adam_exchange='update'" in text


def test_a_skipped_step_is_logged_naming_the_rank_and_tensor(caplog):
    import logging

    def body(rank, tr):
        p = torch.nn.Parameter(torch.zeros(5000))
        opt = hvd_slim.DistributedOptimizer(torch.optim.SGD([p], lr=0.1),
                                            named_parameters=[("w", p)], transport=tr)
        for t in range(3):
            opt.zero_grad()
            p.grad = torch.ones(5000)
            if rank == 1 and t == 1:
                p.grad[7] = float("nan")
            opt.step()
        return opt.comm_stats()["skipped_steps"]

    with caplog.at_level(logging.WARNING, logger="hvd_slim"):
        assert run_ranks(2, body) == [1, 1]
    warned = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warned) == 2 and all("rank 1" in w and "'w'" in w for w in warned), warned


@pytest.mark.parametrize("delay", [0, 1])
def test_rounds_after_an_elastic_rebind_run_on_the_new_transport(monkeypatch, delay):
    """elastic/rebind.py swapped the optimizer's exchange, but with local_steps > 1 the round
    ends (and a delayed round's flight) kept the old one: the first round after a recovery ran
    on the dead transport. Here the old transport raises once replaced, and the rounds after
    the rebind must still agree on every rank, bitwise."""
    from hvd_slim.elastic.rebind import rebind
    from hvd_slim.runtime import basics

    survivors = FakeCluster(2)
    new_of = {}
    monkeypatch.setattr(basics, "world_transport", lambda: new_of[threading.get_ident()])

    torch.manual_seed(0)
    init = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 3)).state_dict()

    def dead(*args, **kwargs):
        raise RuntimeError("the old transport was used after the rebind")

    def body(rank, tr):
        tr.name = "mpi"   # rebind moves MPI exchanges only
        m = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
        m.load_state_dict(init)   # not the global generator, which the rank threads share
        opt = hvd_slim.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
            named_parameters=m.named_parameters(), transport=tr, local_steps=2,
            outer_delay=delay, min_compress_numel=100, density=0.1)

        def steps(first, count):
            for t in range(first, first + count):
                g = torch.Generator().manual_seed(100 * rank + t)
                x = torch.randn(16, 40, generator=g)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(m(x), (x[:, 0] > 0).long()).backward()
                opt.step()

        steps(0, 4)
        opt.flush()
        new = survivors.transport(rank)
        new.name = "mpi"
        new_of[threading.get_ident()] = new
        assert rebind(opt)
        for what in ("gather", "broadcast", "gather_tensor", "broadcast_tensor"):
            setattr(tr, what, dead)
        steps(4, 6)
        opt.flush()
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    out = run_ranks(2, body)
    assert torch.equal(out[0], out[1])
