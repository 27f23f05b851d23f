"""DistributedOptimizer(process_set=...) under mpirun, at any world size: the even and the odd
ranks' sets ([0] and [1] at 2 ranks, [0, 2] and [1] at 3) train different seeded models at the
same time. Within a set the replicas are bitwise identical and equal a single-process
simulation of the set's ranks (FakeCluster threads, no MPI); conservation holds over the set's
workers; the handshake catches a mismatch inside a set; bad arguments are refused on every rank
alike; a checkpoint resumes bitwise within its set and is refused by another.

The set's optimizers pass transport="mpi": the tier also runs with HVD_SLIM_TRANSPORT=gloo, and
under mpirun a process set's exchange runs on MPI only (gloo/nccl are refused there, tested
below; under torchrun it runs on Gloo: tests/torchrun).
"""
from __future__ import annotations

import os

import pytest
import torch
from mpi4py import MPI

from hvd_slim.exchange import ExchangeError
from hvd_slim.transport import run_ranks

from test_optimizer_mpi import Net, batch, digest, flat, flat_grads, held_residual

COMM = MPI.COMM_WORLD
STEPS = 8
# Each set trains its own model with its own settings.
SETTINGS = {0: dict(density=0.02, seed=3), 1: dict(density=0.05, seed=11, exploration=0.2)}


@pytest.fixture(scope="module")
def set_comm():
    """mpi4py's own communicator of this rank's set (even or odd ranks), for references that do
    not go through hvd_slim."""
    comm = COMM.Split(COMM.Get_rank() % 2, COMM.Get_rank())
    yield comm
    comm.Free()


def seeded_net(seed):
    """Net, moved off its common start by ``seed``: each set trains a different model."""
    model = Net()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def wrap(model, opt=None, **kw):
    import hvd_slim as hvd
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    kw.setdefault("min_compress_numel", 1000)
    return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kw)


def train(model, opt, steps, rank):
    for t in steps:
        x, y = batch(t, rank)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def mine(hvd, sets):
    even, odd = sets
    return (even, 0) if hvd.rank() % 2 == 0 else (odd, 1)


def test_two_sets_train_apart_and_match_a_simulation_of_their_ranks(hvd, sets):
    ps, which = mine(hvd, sets)
    members, kw = ps.ranks, SETTINGS[which]
    model = seeded_net(kw["seed"])
    opt = wrap(model, process_set=ps, transport="mpi", **kw)
    train(model, opt, range(STEPS), hvd.rank())
    got = flat(model)
    stats = opt.comm_stats()
    assert stats["world_size"] == len(members) and stats["steps"] == STEPS
    assert opt.slim_config.server_rank == members[0]   # the set's first rank, a job rank
    # Bitwise identical within the set; the other set trained another model.
    digests = COMM.allgather((which, digest(got)))
    assert len({d for w, d in digests if w == which}) == 1, digests
    assert len({d for _, d in digests}) == (2 if hvd.size() > 1 else 1), digests
    # The same ranks simulated in this process (threads over FakeCluster, no MPI): the models
    # are built here first, since Net() seeds torch's global generator.
    models = [seeded_net(kw["seed"]) for _ in members]

    def simulated(r, transport):
        sim_opt = wrap(models[r], transport=transport, **kw)
        train(models[r], sim_opt, range(STEPS), members[r])
        return flat(models[r])

    expected = run_ranks(len(members), simulated, timeout=120)[ps.rank()]
    assert torch.equal(got, expected)


@pytest.mark.parametrize("servers", [1, "all"])
def test_conservation_within_the_set(hvd, sets, set_comm, servers):
    """op=Sum: what was pulled + every residual of the set's ranks (workers' and servers') is
    the sum of the gradients the set's ranks computed; the other set's gradients are not in it.
    With a server shard per rank of the set, the shards' roots are the set's ranks."""
    ps, which = mine(hvd, sets)
    model = seeded_net(SETTINGS[which]["seed"])
    opt = wrap(model, opt=torch.optim.SGD(model.parameters(), lr=0.01), density=0.01,
               op=hvd.Sum, process_set=ps, transport="mpi",
               servers=len(ps.ranks) if servers == "all" else servers)
    fed = torch.zeros_like(flat(model), dtype=torch.float64)
    pulled = torch.zeros_like(fed)
    for t in range(6):
        x, y = batch(t, hvd.rank())
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        fed += flat_grads(model)
        opt.synchronize()
        pulled += flat_grads(model)
        with opt.skip_synchronize():
            opt.step()
    ex = opt._exchange
    residual = held_residual(opt, model)

    def set_sum(t):
        buf = t.numpy().copy()
        set_comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        return torch.from_numpy(buf)

    assert torch.allclose(pulled + set_sum(residual), set_sum(fed), rtol=1e-5, atol=1e-5)
    assert ex.residual_norm() > 0


def test_the_handshake_catches_a_mismatch_inside_a_set(hvd, sets):
    """Two ranks of one set disagree on density: both raise the handshake's error, naming the
    field; the ranks outside that set train meanwhile, untouched."""
    n = hvd.size()
    if n == 1:
        pytest.skip("needs two ranks in a set")
    extra = hvd.add_process_set([0, 1]) if n == 2 else None
    ps = extra if extra is not None else sets[0]   # [0, 1], or the even ranks [0, 2, ...]
    try:
        model = seeded_net(1)
        if hvd.rank() in ps.ranks:
            density = 0.1 if hvd.rank() == ps.ranks[-1] else 0.05
            opt = wrap(model, density=density, process_set=ps, transport="mpi")
            with pytest.raises(ExchangeError, match="Config field 'density'"):
                train(model, opt, range(1), hvd.rank())
        else:
            ps_odd = sets[1]
            opt = wrap(model, density=0.05, process_set=ps_odd, transport="mpi")
            train(model, opt, range(3), hvd.rank())
            assert opt.comm_stats()["steps"] == 3
    finally:
        if extra is not None:
            hvd.remove_process_set(extra)


def test_bad_process_set_arguments_are_refused(hvd, sets):
    ps, _ = mine(hvd, sets)
    model = seeded_net(1)
    cases = [(object(), {}, "process_set must be an hvd.ProcessSet"),
             (hvd.ProcessSet([0]), {}, "process_set: .*is not registered"),
             (ps, dict(transport="gloo"), "transport='gloo' cannot run the exchange inside "
                                          "process_set=.*registered, mpi here"),
             (ps, dict(server_rank=hvd.size()), "server_rank must be a rank of the process set")]
    if hvd.size() > 1:   # a removed set (every rank: neither the even nor the odd one)
        gone = hvd.add_process_set(list(range(hvd.size())))
        hvd.remove_process_set(gone)
        cases.append((gone, {}, "process_set: .*is not registered"))
        # A job rank outside this rank's set as the server.
        other = next(r for r in range(hvd.size()) if r not in ps.ranks)
        cases.append((ps, dict(server_rank=other), f"got {other}$"))
    if os.environ.get("HVD_SLIM_TRANSPORT", "").strip().lower() in ("gloo", "nccl"):
        cases.append((ps, dict(transport=None), "environment variable HVD_SLIM_TRANSPORT="))
    for bad, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            wrap(model, process_set=bad, **{"transport": "mpi", **kw})


def test_a_rank_outside_the_set_steps_alone(hvd, sets):
    """As in Horovod, every rank may build the even ranks' optimizer: the odd ranks get the
    plain optimizer, stepping on their own gradients without any communication."""
    even, _ = sets
    model, ref = seeded_net(5), seeded_net(5)
    opt = wrap(model, process_set=even, transport="mpi", density=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    assert isinstance(opt, torch.optim.SGD)
    # hvd_slim's extras run unchanged on every rank, a scaler checked alike
    with pytest.raises(TypeError, match="set_grad_scaler: scaler must be a torch.amp"):
        opt.set_grad_scaler(1024.0)
    opt.set_grad_scaler(None)
    train(model, opt, range(3), hvd.rank())
    if hvd.rank() in even.ranks:
        assert opt.comm_stats()["steps"] == 3
        return
    train(ref, ref_opt, range(3), hvd.rank())
    assert torch.equal(flat(model), flat(ref))
    assert opt.comm_stats()["steps"] == 0 and "hvd_slim" not in opt.state_dict()


def test_a_checkpoint_resumes_bitwise_within_the_set_and_not_elsewhere(hvd, sets):
    ps, which = mine(hvd, sets)
    kw = dict(SETTINGS[which], process_set=ps, transport="mpi")

    def run(split):
        model = seeded_net(kw["seed"])
        opt = wrap(model, **kw)
        saved = None
        for t in range(STEPS):
            if t == split:
                saved = model.state_dict(), opt.state_dict()
                model = seeded_net(kw["seed"])
                opt = wrap(model, **kw)
                model.load_state_dict(saved[0])
                opt.load_state_dict(saved[1])
            train(model, opt, [t], hvd.rank())
        return flat(model), saved

    straight, _ = run(-1)
    resumed, (_, state) = run(4)
    assert torch.equal(straight, resumed)
    assert state["hvd_slim"]["ranks"] == ps.ranks
    # The same state in an optimizer on the whole job (built on every rank) is refused.
    whole = wrap(seeded_net(kw["seed"]), **dict(kw, process_set=None))
    with pytest.raises(ValueError, match=r"saved by an exchange among the job ranks "
                                         rf"\[{', '.join(map(str, ps.ranks))}\]; this optimizer"):
        whole.load_state_dict(state)
