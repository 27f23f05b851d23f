"""``hvd.join()`` with a ``DistributedOptimizer``: uneven data per rank keeps training.

Rank r runs ``2 + r`` steps, then joins, so every world size has ranks that join early while
the others go on. References are computed on every rank from the same seeded batches: the
dense average in which a joined rank's gradient is zero (Horovod's semantics), and
conservation with op=Sum at density 0.01.
"""
import pytest
import torch
from mpi4py import MPI

import hvd_slim as hvd
from hvd_slim.api import join as api_join
from hvd_slim.api.checks import MismatchError

from test_optimizer_mpi import (Net, assert_same_on_every_rank, batch, flat, flat_grads,
                                held_residual, loss_of, wrap)

COMM = MPI.COMM_WORLD


def steps_of(rank):
    return 2 + rank


@pytest.fixture
def broadcasts(monkeypatch):
    """The ids of the optimizers that join() had to broadcast, per call."""
    seen = []

    def recording(served, root):
        seen.append(original(served, root))
        return seen[-1]
    original = api_join.after_join
    monkeypatch.setattr(api_join, "after_join", recording)
    return seen


@pytest.mark.parametrize("overlap, forward", [(1, False), (3, False), (3, True)])
def test_joined_ranks_feed_zeros_to_the_exchange_and_step_alike(broadcasts, overlap, forward):
    """density=1.0: the result equals plain SGD on the average over every rank of the
    gradient each still computes (zero once it has joined), and every replica is equal. With
    overlap=3 the ranks still training queue each step's join round from backward's first
    hook, on the communication thread's behalf; with overlap_forward a rank's last update lands
    as it joins."""
    n, r = hvd.size(), hvd.rank()
    model, ref = Net(), Net()
    opt = wrap(model, opt=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
               density=1.0, overlap=overlap, overlap_forward=forward)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for t in range(steps_of(r)):
        opt.zero_grad()
        loss_of(model, t).backward()
        opt.step()
    assert hvd.join() == n - 1
    assert broadcasts == [[]]   # the joined ranks stepped alike: nothing to repair
    for t in range(steps_of(n - 1)):
        ref_opt.zero_grad()
        total = [torch.zeros_like(p) for p in ref.parameters()]
        for q in range(n):
            if t < steps_of(q):
                ref.zero_grad()
                x, y = batch(t, rank=q)
                torch.nn.functional.cross_entropy(ref(x), y).backward()
                for acc, p in zip(total, ref.parameters()):
                    if p.grad is not None:   # Net's side head is unused
                        acc += p.grad
        for acc, p in zip(total, ref.parameters()):
            p.grad = acc / n
        ref_opt.step()
    assert_same_on_every_rank(flat(model))
    assert torch.allclose(flat(model), flat(ref), rtol=1e-5, atol=1e-6)
    assert opt.comm_stats()["steps"] == steps_of(n - 1)   # the joined ranks exchanged too


@pytest.mark.parametrize("outer_delay", [0, 1])
def test_joined_ranks_serve_local_step_rounds(monkeypatch, outer_delay):
    """local_steps=2: rank r trains 2 + r whole rounds, then joins; the joined ranks serve
    every later round with what they hold (with outer_delay=1 they land each round in flight
    too), so all are on the same global parameters when join ends, and after a flush on the
    same model. (Join then makes the wrapped optimizers' own state equal: under local steps it
    is each rank's.)"""
    n, r = hvd.size(), hvd.rank()
    model = Net()
    opt = wrap(model, opt=torch.optim.AdamW(model.parameters(), lr=1e-3), density=0.05,
               local_steps=2, outer_delay=outer_delay)
    at_join = []
    original = api_join.after_join
    monkeypatch.setattr(api_join, "after_join", lambda served, root: (
        at_join.append(torch.cat([g.reshape(-1) for g in opt._outer.global_params])),
        original(served, root))[1])
    for t in range(2 * steps_of(r)):
        opt.zero_grad()
        loss_of(model, t).backward()
        opt.step()
    assert hvd.join() == n - 1
    assert_same_on_every_rank(at_join[0])   # the global parameters, before join's repair
    if not outer_delay:   # (with it each rank's model also holds its own last round)
        assert torch.equal(flat(model), at_join[0])
    assert opt.comm_stats()["steps"] == steps_of(n - 1) - outer_delay   # one may be in flight
    opt.flush()
    assert_same_on_every_rank(flat(model))
    assert opt.comm_stats()["steps"] == steps_of(n - 1)


@pytest.mark.parametrize("servers", [1, "all"])
def test_a_joined_server_keeps_aggregating_and_nothing_is_lost(servers):
    """density 0.01, op=Sum, server rank 0 joins first: what was pulled, plus every residual
    (workers' and the servers'), equals every gradient fed on any rank. With a server shard
    per rank, every joined rank keeps serving its shard."""
    n, r = hvd.size(), hvd.rank()
    model = Net()
    opt = wrap(model, opt=torch.optim.SGD(model.parameters(), lr=0.01), density=0.01,
               op=hvd.Sum, server_rank=0, servers=n if servers == "all" else servers)
    fed = torch.zeros_like(flat(model), dtype=torch.float64)
    pulled = torch.zeros_like(fed)
    for t in range(steps_of(r)):
        opt.zero_grad()
        loss_of(model, t).backward()
        fed += flat_grads(model)
        opt.synchronize()
        pulled += flat_grads(model)
        with opt.skip_synchronize():
            opt.step()
    hvd.join()
    assert_same_on_every_rank(flat(model))
    pulled = torch.from_numpy(COMM.bcast(pulled.numpy(), root=n - 1))   # it saw every step
    residual = held_residual(opt, model)
    total = torch.from_numpy(COMM.allreduce(residual.numpy(), op=MPI.SUM))
    fed_all = torch.from_numpy(COMM.allreduce(fed.numpy(), op=MPI.SUM))
    assert torch.allclose(pulled + total, fed_all, rtol=1e-5, atol=1e-5)


def test_replicas_are_equal_after_join_even_when_the_others_clip(broadcasts):
    """The active ranks clip between synchronize() and step(), which a joined rank cannot
    repeat; when the last rank joins, every replica takes its parameters and momentum."""
    n, r = hvd.size(), hvd.rank()
    model = Net()
    opt = wrap(model, density=0.05)
    for t in range(steps_of(r)):
        opt.zero_grad()
        loss_of(model, t).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        with opt.skip_synchronize():
            opt.step()
    mine = flat(model).clone()
    last = hvd.join()
    assert last == n - 1
    assert broadcasts == [[opt._join_id] if n > 1 else []]
    if r == last:
        assert torch.equal(flat(model), mine)   # the root's replica is the one kept
    assert_same_on_every_rank(flat(model))
    momenta = [opt.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()
               if "momentum_buffer" in opt.state[p]]
    assert_same_on_every_rank(torch.cat(momenta))
    opt.zero_grad()   # training goes on from equal replicas
    loss_of(model, 100).backward()
    opt.step()
    assert_same_on_every_rank(flat(model))


def test_flush_is_served_by_a_joined_rank():
    n, r = hvd.size(), hvd.rank()
    model = Net()
    opt = wrap(model, density=0.01)
    for t in range(2):
        opt.zero_grad()
        loss_of(model, t).backward()
        opt.step()
    if r == 0:
        hvd.join()
    else:
        opt.flush()
        hvd.join()
    if n > 1:   # every rank flushed, the joined one inside join()
        assert opt._exchange.residual_norm() == 0.0
    assert_same_on_every_rank(flat(model))


def test_ranks_stepping_while_another_allreduces_all_raise():
    """Out of step (rank 0 allreduces, the others step): one MismatchError on every rank, no
    hang; the refused step changed nothing, so training goes on."""
    n, r = hvd.size(), hvd.rank()
    if n < 2:
        pytest.skip("needs two ranks")
    model = Net()
    opt = wrap(model, density=0.01)
    before = flat(model).clone()
    if r == 0:
        with pytest.raises(MismatchError, match="ranks made different calls"):
            hvd.allreduce(torch.ones(2))
    else:
        opt.zero_grad()
        loss_of(model, 0).backward()
        with pytest.raises(MismatchError, match=r"DistributedOptimizer #\d+ step"):
            opt.step()
        assert torch.equal(flat(model), before)
        assert opt._exchange.step_count == 0
        opt.synchronize()   # the gradient is still there; exchange it with rank 0 below
    if r == 0:
        opt.zero_grad()
        loss_of(model, 0).backward()
        opt.synchronize()
    with opt.skip_synchronize():
        opt.step()
    assert_same_on_every_rank(flat(model))
