"""``DistributedOptimizer`` after ``hvd.init()`` under torchrun: its exchange runs on Gloo
(``"auto"``), against a dense reference on torch.distributed's own all_reduce (the default
group, none of hvd_slim's code) and a single-process simulation of the same ranks (FakeCluster
threads); the handshake, join and process sets as under mpirun; ``transport="mpi"`` refused.
Every rank runs these in the same order (tests/torchrun/conftest.py)."""
from __future__ import annotations

import hashlib
from typing import Any, Iterable

import pytest
import torch
import torch.distributed as dist

from hvd_slim.api import join as api_join
from hvd_slim.exchange import ExchangeError
from hvd_slim.transport import run_ranks

STEPS = 5


def net(hidden: int = 32, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)   # the same start on every rank, as broadcast_parameters gives
    return torch.nn.Sequential(torch.nn.Linear(24, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 4))


def batch(step: int, rank: int) -> Any:
    g = torch.Generator().manual_seed(7919 * rank + step)
    return torch.randn(16, 24, generator=g), torch.randint(0, 4, (16,), generator=g)


def wrap(hvd: Any, model: torch.nn.Module, **kw: Any) -> Any:
    kw.setdefault("min_compress_numel", 100)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kw)


def train(model: torch.nn.Module, opt: Any, steps: Iterable[int], rank: int) -> None:
    for t in steps:
        x, y = batch(t, rank)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("hierarchical", [False, True])
def test_dense_exchange_equals_sgd_on_the_all_reduced_gradient(hvd: Any, hierarchical: bool) -> None:
    """density=1.0 moves every coordinate: the result is momentum SGD on the average gradient,
    computed here with torch.distributed.all_reduce on the default group. hierarchical=True
    combines this host's ranks first, on Gloo groups of their own."""
    n, r = hvd.size(), hvd.rank()
    model, ref = net(), net()
    opt = wrap(hvd, model, density=1.0, hierarchical=hierarchical)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for t in range(STEPS):
        x, y = batch(t, r)
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= n
        ref_opt.step()
    train(model, opt, range(STEPS), r)
    assert opt.comm_stats()["transport"] == "gloo"
    assert torch.allclose(flat(model), flat(ref), rtol=1e-5, atol=1e-6)


def simulate(hvd: Any, ranks: list, seed: int, monkeypatch: Any) -> list:
    """``ranks`` (job ranks) trained as :func:`train` does, simulated in this process over
    FakeCluster threads; their parameters. The simulated optimizers span as many ranks as the
    job may, but are not the job's: they must not start join rounds on it."""
    monkeypatch.setattr(api_join, "register", lambda *args: None)
    models = [net(seed=seed) for _ in ranks]   # built first: net() seeds the global generator

    def simulated(q: int, transport: Any) -> torch.Tensor:
        train(models[q], wrap(hvd, models[q], density=0.05, transport=transport), range(STEPS),
              ranks[q])
        return flat(models[q])
    return run_ranks(len(ranks), simulated, timeout=120)


def test_sparse_exchange_is_bitwise_a_simulation_of_the_same_ranks(hvd: Any,
                                                                   monkeypatch: Any) -> None:
    """The defaults (a sparse exchange over Gloo): every replica is bitwise equal, and equal to
    the same ranks simulated in this process over FakeCluster (no network at all)."""
    n, r = hvd.size(), hvd.rank()
    model = net()
    opt = wrap(hvd, model, density=0.05)
    train(model, opt, range(STEPS), r)
    got = flat(model)
    assert len(set(hvd.allgather_object(digest(got)))) == 1
    assert torch.equal(got, simulate(hvd, list(range(n)), 0, monkeypatch)[r])


def test_the_handshake_refuses_different_models_on_every_rank(hvd: Any) -> None:
    n, r = hvd.size(), hvd.rank()
    model = net(hidden=40 if r == n - 1 else 32)
    opt = wrap(hvd, model)
    with pytest.raises(ExchangeError) as info:
        train(model, opt, range(1), r)
    messages = hvd.allgather_object(str(info.value))
    assert len(set(messages)) == 1, messages
    assert f"rank(s) {n - 1}" in messages[0] or f"rank {n - 1}" in messages[0], messages[0]


def test_joined_ranks_keep_serving_the_exchange(hvd: Any) -> None:
    """Rank q trains 2 + q steps, then joins: density=1.0, so the result is SGD on the average
    in which a joined rank's gradient is zero (Horovod's semantics), on every rank alike."""
    n, r = hvd.size(), hvd.rank()
    model, ref = net(), net()
    opt = wrap(hvd, model, density=1.0)
    train(model, opt, range(2 + r), r)
    assert hvd.join() == n - 1
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for t in range(2 + n - 1):
        ref_opt.zero_grad()
        grads = [torch.zeros_like(p) for p in ref.parameters()]
        for q in range(n):
            if t < 2 + q:   # rank q still trains at step t
                ref.zero_grad()
                x, y = batch(t, q)
                torch.nn.functional.cross_entropy(ref(x), y).backward()
                grads = [g + p.grad for g, p in zip(grads, ref.parameters())]
        for p, g in zip(ref.parameters(), grads):
            p.grad = g / n
        ref_opt.step()
    assert torch.allclose(flat(model), flat(ref), rtol=1e-5, atol=1e-6)
    assert len(set(hvd.allgather_object(digest(flat(model))))) == 1


def test_an_optimizer_inside_a_process_set_runs_on_its_gloo_group(hvd: Any, sets: Any,
                                                                   monkeypatch: Any) -> None:
    r = hvd.rank()
    ps = sets[r % 2]
    members = ps.ranks
    model = net(seed=1 + r % 2)   # each set trains its own model
    opt = wrap(hvd, model, density=0.05, process_set=ps)
    train(model, opt, range(STEPS), r)
    stats = opt.comm_stats()
    assert stats["transport"] == "gloo" and stats["world_size"] == len(members)
    got = flat(model)
    digests = hvd.allgather_object((r % 2, digest(got)))
    assert len({d for w, d in digests if w == r % 2}) == 1, digests
    assert torch.equal(got, simulate(hvd, members, 1 + r % 2, monkeypatch)[ps.rank()])
    with pytest.raises(RuntimeError, match=r"transport='mpi' needs MPI"):
        wrap(hvd, net(), process_set=ps, transport="mpi")


def test_transport_mpi_is_refused_naming_the_keyword(hvd: Any) -> None:
    with pytest.raises(RuntimeError, match=r"transport='mpi' needs MPI: .*pass transport='gloo'"):
        wrap(hvd, net(), transport="mpi")
