"""An exchange among some of the job's ranks (``process_set``), in one process: ``server_rank``
is a job rank translated to its position in the set, and checkpoints name the ranks they were
made among. (The MPI tier runs real process sets: tests/distributed/test_optimizer_process_sets.py.)"""
import pytest
import torch

from hvd_slim.config import ConfigError, SlimConfig
from hvd_slim.exchange import Layout, SlimExchange
from hvd_slim.transport import run_ranks

from test_exchange import grad_for, make_params

CFG = dict(density=0.02, min_compress_numel=1000)


def run(config, ranks=None, steps=3):
    """Per simulated rank: its pulled updates and its exchange."""
    def rank_fn(rank, transport):
        named = make_params()
        ex = SlimExchange(Layout(named, config, lambda dt: dt), config, transport, ranks=ranks)
        pulled = []
        for t in range(steps):
            for name, p in named:
                p.grad = grad_for(rank, t, name, p.shape)
            ex.step()
            pulled.append(torch.cat([p.grad.reshape(-1) for _, p in named]))
        return pulled, ex
    return run_ranks(2, rank_fn)


def test_a_job_rank_server_is_its_position_in_the_set():
    in_set = run(SlimConfig(server_rank=3, **CFG), ranks=[1, 3])
    plain = run(SlimConfig(server_rank=1, **CFG))
    for (got, ex), (want, _) in zip(in_set, plain):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert ex.cfg.server_rank == 1 and ex.ranks == [1, 3]
    assert in_set[1][1].server is not None and in_set[0][1].server is None


def test_a_server_outside_the_set_is_refused():
    with pytest.raises(ConfigError, match=r"server_rank must be a rank of the process set "
                                          r"\[1, 3\] \(a job rank\), got 0"):
        SlimConfig(server_rank=0, **CFG).for_ranks([1, 3])


def test_a_checkpoint_loads_only_among_the_same_ranks():
    (_, ex0), (_, ex1) = run(SlimConfig(server_rank=1, **CFG), ranks=[1, 3])
    state = ex1.state_dict()
    assert state["ranks"] == [1, 3]
    (_, other0), (_, other1) = run(SlimConfig(server_rank=0, **CFG), ranks=[0, 2], steps=0)
    with pytest.raises(ValueError, match=r"saved by an exchange among the job ranks \[1, 3\]; "
                                         r"this optimizer exchanges among \[0, 2\]\. Resume "
                                         r"with the same process_set"):
        other1.load_state_dict(state)
    (_, same0), (_, same1) = run(SlimConfig(server_rank=1, **CFG), ranks=[1, 3], steps=0)
    same1.load_state_dict(state)
    assert same1.step_count == 3


def test_a_checkpoint_from_before_process_sets_is_a_whole_jobs():
    (_, ex0), (_, ex1) = run(SlimConfig(**CFG))
    state = ex1.state_dict()
    del state["ranks"], state["in_set"]
    (_, fresh0), (_, fresh1) = run(SlimConfig(**CFG), steps=0)
    fresh1.load_state_dict(state)
    (_, set0), (_, set1) = run(SlimConfig(**CFG), ranks=[0, 2], steps=0)
    with pytest.raises(ValueError, match=r"job ranks \[0, 1\]; this optimizer exchanges "
                                         r"among \[0, 2\]"):
        set1.load_state_dict(state)
