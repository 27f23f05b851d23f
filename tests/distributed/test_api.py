"""The Horovod-shaped API under mpirun, at any world size, against closed forms.

Every test runs on every rank in the same order and must make the same collective calls there.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from mpi4py import MPI

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64, torch.int16, torch.uint8]


def _rows(hvd, value):
    """Every rank's ``value`` (a plain Python object), in rank order."""
    return hvd.allgather_object(value)


# ---- basics ---------------------------------------------------------------------------------

def test_rank_and_size_match_env_and_mpi(hvd):
    world = MPI.COMM_WORLD
    assert hvd.is_initialized() and hvd.mpi_enabled() and hvd.mpi_built()
    assert (hvd.rank(), hvd.size()) == (world.Get_rank(), world.Get_size())
    assert hvd.env_rank_size()[:2] == (hvd.rank(), hvd.size())
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    assert (hvd.local_rank(), hvd.local_size()) == (node.Get_rank(), node.Get_size())
    if "OMPI_COMM_WORLD_LOCAL_RANK" in os.environ:
        assert hvd.local_rank() == int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"])
        assert hvd.local_size() == int(os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"])
    cross = world.Split(node.Get_rank(), world.Get_rank())
    assert (hvd.cross_rank(), hvd.cross_size()) == (cross.Get_rank(), cross.Get_size())
    node.Free()
    cross.Free()
    assert hvd.mpi_threads_supported() == (MPI.Query_thread() == MPI.THREAD_MULTIPLE)
    assert not any([hvd.gloo_enabled(), hvd.nccl_built(), hvd.cuda_built(), hvd.rocm_built()])
    assert hvd.mpi_enabled() and hvd.backend() == "mpi"
    # Gloo is built where torch has it (hvd.init() under torchrun runs on it).
    assert hvd.gloo_built() == torch.distributed.is_gloo_available()


def test_init_is_idempotent(hvd):
    before = hvd.job_comm()
    hvd.init()
    assert hvd.job_comm() is before and hvd.world_transport() is hvd.world_transport()


def test_init_on_rank_lists_and_communicators(hvd):
    n, wr = hvd.size(), MPI.COMM_WORLD.Get_rank()
    hvd.shutdown()
    try:
        assert not hvd.is_initialized()
        for bad, error in (([n], ValueError), ([0, 0], ValueError), ([], ValueError), ("x", TypeError)):
            with pytest.raises(error, match="init"):
                hvd.init(comm=bad)
        with pytest.raises(ValueError, match="has not been initialized; use hvd.init"):
            hvd.rank()
        with pytest.raises(ValueError, match="has not been initialized"):
            hvd.allreduce(torch.ones(1))
        hvd.init(comm=list(reversed(range(n))))  # a reordered sub-communicator of every rank
        assert (hvd.rank(), hvd.size()) == (n - 1 - wr, n)
        assert hvd.allgather(torch.tensor([wr])).tolist() == list(reversed(range(n)))
        hvd.shutdown()
        if wr == 0:
            hvd.init(comm=[0])
            assert (hvd.rank(), hvd.size()) == (0, 1) and hvd.allreduce(torch.ones(1)).item() == 1
            hvd.shutdown()
        else:
            with pytest.raises(ValueError, match="not in the list"):
                hvd.init(comm=[0])
        hvd.init(comm=MPI.COMM_WORLD)
        assert hvd.rank() == wr and hvd.job_comm() != MPI.COMM_WORLD
        with pytest.raises(ValueError, match="process_sets"):
            hvd.shutdown() or hvd.init(process_sets="every")
    finally:
        hvd.shutdown()
        hvd.init()
    assert hvd.rank() == wr


def test_env_rank_discovery(hvd):
    from hvd_slim.runtime import env
    assert env.env_rank_size({}) is None
    assert env.env_rank_size({"PMI_RANK": "2", "PMI_SIZE": "4"}) == (2, 4, "PMI_RANK/PMI_SIZE")
    both = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3", "HOROVOD_RANK": "1",
            "HOROVOD_SIZE": "3"}
    assert env.env_rank_size(both)[:2] == (1, 3)
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE say rank 1 of 3 "
                                         "but HOROVOD_RANK/HOROVOD_SIZE say rank 0 of 3"):
        env.env_rank_size(dict(both, HOROVOD_RANK="0"))
    with pytest.raises(ValueError, match="HOROVOD_SIZE is not"):
        env.env_rank_size({"HOROVOD_RANK": "0"})
    with pytest.raises(ValueError, match="not an integer"):
        env.env_rank_size({"PMI_RANK": "x", "PMI_SIZE": "2"})
    with pytest.raises(RuntimeError, match=r"launcher says this is rank 1 of 2 .*MPI reports rank 0 of 1"):
        env.check_against_mpi(0, 1, {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
    env.check_against_mpi(1, 2, {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})


# ---- allreduce ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS + INTS)
def test_allreduce_ops_closed_form(hvd, dtype):
    n, r = hvd.size(), hvd.rank()
    base = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    t = (base + r).to(dtype)
    tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
    got_sum = hvd.allreduce(t, op=hvd.Sum)
    assert got_sum.dtype == dtype and got_sum.shape == t.shape
    torch.testing.assert_close(got_sum.double(), n * base.double() + n * (n - 1) / 2, rtol=tol, atol=0)
    expected_avg = base.double() + (n - 1) / 2
    if not dtype.is_floating_point:  # integers average by truncation, as in Horovod
        expected_avg = torch.trunc((n * base.double() + n * (n - 1) / 2) / n)
    torch.testing.assert_close(hvd.allreduce(t).double(), expected_avg, rtol=tol, atol=0)
    torch.testing.assert_close(hvd.allreduce(t, op=hvd.Min).double(), base.double(), rtol=0, atol=0)
    torch.testing.assert_close(hvd.allreduce(t, op=hvd.Max).double(), base.double() + n - 1, rtol=0, atol=0)
    product = hvd.allreduce(torch.full((3,), r + 1).to(dtype), op=hvd.Product)
    assert product.double().tolist() == [float(math.factorial(n))] * 3
    assert torch.equal(t, (base + r).to(dtype)), "allreduce must not modify its input"


def test_allreduce_scale_factors(hvd):
    n, r = hvd.size(), hvd.rank()
    t = torch.full((4,), float(r + 1), dtype=torch.float64)
    total = n * (n + 1) / 2
    got = hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    assert torch.allclose(got, torch.full((4,), total / 2, dtype=torch.float64))
    got = hvd.allreduce(t, op=hvd.Average, prescale_factor=3.0, postscale_factor=2.0)
    assert torch.allclose(got, torch.full((4,), 6 * total / n, dtype=torch.float64))
    got16 = hvd.allreduce(t.half(), op=hvd.Sum, prescale_factor=0.5)
    assert got16.dtype == torch.float16 and torch.allclose(got16.double(), torch.full((4,), total / 2,
                                                                                   dtype=torch.float64))


def test_allreduce_average_flag_and_inplace_variants(hvd):
    n, r = hvd.size(), hvd.rank()
    with pytest.warns(DeprecationWarning):
        assert hvd.allreduce(torch.tensor([float(r)]), average=False).item() == n * (n - 1) / 2
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * (r + 1)  # non-contiguous
    expected = torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * (n * (n + 1) / 2)
    out = hvd.allreduce_(t, op=hvd.Sum)
    assert out is t and torch.equal(t, expected)
    u = torch.full((5,), float(r), dtype=torch.bfloat16)
    handle = hvd.allreduce_async_(u, op=hvd.Max)
    assert hvd.poll(handle) in (True, False)   # pending or done: the call runs in the background
    assert hvd.synchronize(handle) is u and u.tolist() == [float(n - 1)] * 5
    handle = hvd.allreduce_async(torch.ones(2) * r, name="avg")
    assert torch.allclose(hvd.synchronize(handle), torch.full((2,), (n - 1) / 2))
    assert hvd.synchronize(handle) is None


def test_allreduce_fp16_compression(hvd):
    n, r = hvd.size(), hvd.rank()
    t = torch.linspace(-1, 1, 33, dtype=torch.float64) * (r + 1)
    out = hvd.allreduce(t, op=hvd.Sum, compression=hvd.Compression.fp16)
    assert out.dtype == torch.float64
    expected = torch.linspace(-1, 1, 33, dtype=torch.float64) * (n * (n + 1) / 2)
    assert torch.allclose(out, expected, atol=1e-2)
    ints = hvd.allreduce(torch.full((3,), r, dtype=torch.int64), op=hvd.Sum, compression=hvd.Compression.fp16)
    assert ints.dtype == torch.int64 and ints.tolist() == [n * (n - 1) // 2] * 3


def test_allreduce_is_differentiable(hvd):
    n, r = hvd.size(), hvd.rank()
    x = torch.ones(3, requires_grad=True)
    hvd.allreduce(x * (r + 1), op=hvd.Sum).sum().backward()
    # d/dx of sum over ranks: the upstream ones are summed over ranks (n), times this rank's factor.
    assert x.grad.tolist() == [float(n * (r + 1))] * 3


# ---- allgather ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool])
def test_allgather_differing_first_dims(hvd, dtype):
    n, r = hvd.size(), hvd.rank()
    t = torch.full((r + 1, 2, 3), r % 2 if dtype == torch.bool else r).to(dtype)
    out = hvd.allgather(t)
    assert out.dtype == dtype and out.shape == (n * (n + 1) // 2, 2, 3)
    expected = torch.cat([torch.full((k + 1, 2, 3), k % 2 if dtype == torch.bool else k) for k in range(n)])
    assert torch.equal(out, expected.to(dtype))
    assert torch.equal(hvd.synchronize(hvd.allgather_async(t)), out)


def test_allgather_empty_scalar_and_gradient(hvd):
    n, r = hvd.size(), hvd.rank()
    rows = hvd.allgather(torch.zeros((r % 2, 4)))
    assert rows.shape == (sum(k % 2 for k in range(n)), 4)
    assert hvd.allgather(torch.tensor(float(r))).tolist() == [float(k) for k in range(n)]
    x = torch.ones(r + 1, 2, requires_grad=True)
    (hvd.allgather(x) * 2).sum().backward()
    assert torch.allclose(x.grad, torch.full((r + 1, 2), 2.0))  # Horovod: averaged upstream grad


# ---- broadcast ------------------------------------------------------------------------------

def test_broadcast_from_each_root(hvd):
    n, r = hvd.size(), hvd.rank()
    for root in range(n):
        t = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (r + 1)
        out = hvd.broadcast(t, root_rank=root)
        assert torch.equal(out, torch.arange(6, dtype=torch.float32).reshape(2, 3) * (root + 1))
        assert torch.equal(t, torch.arange(6, dtype=torch.float32).reshape(2, 3) * (r + 1))
        u = torch.full((3, 2), r, dtype=torch.bfloat16).t()  # non-contiguous, in place
        assert hvd.broadcast_(u, root) is u and u.tolist() == [[float(root)] * 3] * 2
        v = torch.tensor(r, dtype=torch.int64)
        assert hvd.synchronize(hvd.broadcast_async_(v, root)).item() == root
        assert hvd.synchronize(hvd.broadcast_async(torch.tensor([r]), root)).tolist() == [root]


def test_broadcast_object_and_allgather_object(hvd):
    n, r = hvd.size(), hvd.rank()
    for root in range(n):
        obj = {"rank": r, "nested": [r, (r, "x" * r)], "t": torch.tensor([r])}
        got = hvd.broadcast_object(obj, root_rank=root)
        assert got["rank"] == root and got["nested"] == [root, (root, "x" * root)]
        assert got["t"].tolist() == [root]
        if r == root:
            assert got is obj
    assert hvd.allgather_object({"r": r, "pad": "y" * (3 * r)}) == [{"r": k, "pad": "y" * (3 * k)}
                                                                      for k in range(n)]


# ---- parameters and optimizer state ---------------------------------------------------------

def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.ReLU(),
                               torch.nn.Linear(3, 2))


def _values(tensors):
    return [(str(t.dtype), list(t.shape), t.detach().tolist()) for t in tensors]


@pytest.mark.parametrize("root_of", [lambda n: 0, lambda n: n - 1])
def test_broadcast_parameters_state_dict(hvd, root_of):
    n, r = hvd.size(), hvd.rank()
    root = root_of(n)
    model = _model(seed=10 + r)
    model(torch.randn(6, 4))  # moves the BatchNorm running stats and its int64 counter
    mine = _values(model.state_dict().values())
    hvd.broadcast_parameters(model.state_dict(), root_rank=root)
    after = _values(model.state_dict().values())
    everyone = _rows(hvd, after)
    assert all(x == everyone[root] for x in everyone)
    if r == root:
        assert after == mine


def test_broadcast_parameters_named_and_plain_lists(hvd):
    n, r = hvd.size(), hvd.rank()
    model = _model(seed=20 + r)
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=0)
    everyone = _rows(hvd, _values(model.parameters()))
    assert all(x == everyone[0] for x in everyone)
    for p in model.parameters():
        assert p.requires_grad and p.grad is None
    with torch.no_grad():
        for p in model.parameters():
            p.add_(r)
    hvd.broadcast_parameters(model.named_parameters(), root_rank=n - 1)  # a generator works too
    hvd.broadcast_parameters([p for p in model.buffers()], root_rank=n - 1)
    everyone = _rows(hvd, _values(list(model.parameters()) + list(model.buffers())))
    assert all(x == everyone[n - 1] for x in everyone)


def _optimizer_snapshot(opt):
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    state = []
    for g in opt.param_groups:
        for p in g["params"]:
            st = opt.state.get(p, {})
            state.append({k: (("tensor",) + tuple(_values([v])[0]) if torch.is_tensor(v)
                              else (type(v).__name__, v)) for k, v in st.items()})
    return repr(groups), state


OPTIMIZERS = {
    "sgd_momentum": lambda params, r: torch.optim.SGD(params, lr=0.1 * (r + 1), momentum=0.9,
                                                      weight_decay=0.1),
    "adam": lambda params, r: torch.optim.Adam(params, lr=0.01 * (r + 1), betas=(0.8, 0.9 + 0.01 * r),
                                               weight_decay=0.1),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_broadcast_optimizer_state(hvd, kind):
    n, r = hvd.size(), hvd.rank()
    root = n - 1
    model = _model(seed=30 + r)
    opt = OPTIMIZERS[kind](model.parameters(), r)
    if r == root:  # only the root has trained: the others start from an empty state
        for step in range(3):
            opt.zero_grad()
            model(torch.randn(5, 4) * (step + 1)).pow(2).sum().backward()
            opt.step()
        first = next(iter(model.parameters()))
        opt.state[first]["custom_count"] = 7  # a plain Python scalar in the state
    params_before = _values(model.parameters())
    grads_before = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=root)
    # The initialising step (zero grads, but weight decay) must not have moved anything; as in
    # Horovod, a parameter without a gradient then has a zero one (the non-roots' here).
    assert _values(model.parameters()) == params_before
    for p, g in zip(model.parameters(), grads_before):
        assert torch.equal(p.grad, torch.zeros_like(p) if g is None else g)
        assert g is not None or (not p.grad.is_sparse and p.grad.shape == p.shape)
    everyone = _rows(hvd, _optimizer_snapshot(opt))
    assert all(x == everyone[root] for x in everyone)
    assert everyone[r][1][0]["custom_count"] == ("int", 7)
    assert opt.param_groups[0]["lr"] == OPTIMIZERS[kind]([torch.zeros(1)], root).param_groups[0]["lr"]


def test_broadcast_optimizer_state_leaves_zero_gradients_where_there_were_none(hvd):
    """Horovod's behaviour: after the call every trainable parameter has a gradient, zero where
    it had none (sparse for a sparse embedding given as ``model``); frozen ones keep None."""
    torch.manual_seed(60)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 2))
    model[1].bias.requires_grad_(False)
    # Plain SGD: weight decay refuses sparse gradients, momentum would keep a sparse buffer.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _values(model.parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0, model=model)
    assert _values(model.parameters()) == before
    emb, weight, bias = model[0].weight, model[1].weight, model[1].bias
    assert emb.grad.is_sparse and torch.equal(emb.grad.to_dense(), torch.zeros(10, 3))
    assert torch.equal(weight.grad, torch.zeros(2, 3)) and bias.grad is None


class _FakeWrapped(torch.optim.SGD):
    """Stands in for an hvd_slim DistributedOptimizer: its own step() would start an exchange."""

    _hvd_slim_wrapped = True

    def step(self, closure=None):
        raise AssertionError("broadcast_optimizer_state ran the wrapper's step(); it must call the parent's")


def test_broadcast_optimizer_state_of_wrapped_optimizer(hvd):
    r = hvd.rank()
    model = _model(seed=40 + r)
    opt = _FakeWrapped(model.parameters(), lr=0.1, momentum=0.5, weight_decay=0.01)
    before = _values(model.parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert _values(model.parameters()) == before
    assert all("momentum_buffer" in opt.state[p] for p in model.parameters())
    everyone = _rows(hvd, _optimizer_snapshot(opt))
    assert all(x == everyone[0] for x in everyone)


def test_broadcast_optimizer_state_of_a_fresh_slim_optimizer_runs_no_exchange(hvd):
    """Creating the state (a step on zero gradients) is local: no Slim-DP step runs or counts."""
    r = hvd.rank()
    torch.manual_seed(50 + r)
    model = torch.nn.Sequential(torch.nn.Linear(40, 60), torch.nn.ReLU(), torch.nn.Linear(60, 3))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1),
                                                   momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   min_compress_numel=1000)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    stats = opt.comm_stats()
    assert (stats["steps"], stats["bytes_pushed"], stats["bytes_pulled"]) == (0, 0, 0), stats
    assert opt._exchange.step_count == 0
    assert all("momentum_buffer" in opt.state[p] for p in model.parameters())
    assert opt.param_groups[0]["lr"] == 0.1
    opt.zero_grad()
    model(torch.randn(8, 40)).pow(2).mean().backward()
    opt.step()
    assert opt.comm_stats()["steps"] == 1
    everyone = _rows(hvd, _values(model.parameters()))
    assert all(x == everyone[0] for x in everyone)


# ---- errors (raised on every rank alike, so no rank is left waiting) --------------------------

def test_unsupported_arguments_raise(hvd):
    n = hvd.size()
    t = torch.ones(3)
    with pytest.raises(TypeError, match="Adasum"):   # Adasum itself: test_collectives_more.py
        hvd.allreduce(torch.ones(3, dtype=torch.int32), op=hvd.Adasum)
    with pytest.raises(ValueError, match="op=7"):
        hvd.allreduce_async_(t, op=7)
    for call in (lambda: hvd.allreduce(t, process_set=object()), lambda: hvd.allgather(t, process_set=1),
                 lambda: hvd.broadcast_(t, 0, process_set=1), lambda: hvd.barrier(process_set=1),
                 lambda: hvd.broadcast_object(1, 0, process_set=1)):
        with pytest.raises(ValueError, match="process_set"):
            call()
    for bad in (-1, n, "0", True, 0.0, None):
        with pytest.raises(ValueError, match="root_rank"):
            hvd.broadcast(t, root_rank=bad)
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast_object("x", root_rank=n)
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast_parameters([t], root_rank=n)
    with pytest.raises(TypeError, match="torch.Tensor"):
        hvd.allreduce([1.0, 2.0])
    with pytest.raises(ValueError, match="supersedes"):
        hvd.allreduce(t, average=True, op=hvd.Sum)
    with pytest.raises(ValueError, match="op=42"):
        hvd.allreduce(t, op=42)
    with pytest.raises(ValueError, match="LBFGS"):
        hvd.broadcast_optimizer_state(torch.optim.LBFGS([torch.zeros(1, requires_grad=True)]), 0)
    with pytest.raises(ValueError, match="invalid params"):
        hvd.broadcast_parameters(t, root_rank=0)
    with pytest.raises(ValueError, match="unknown handle"):
        hvd.poll(10 ** 9)
    with pytest.raises(TypeError, match="bool"):
        hvd.allreduce(torch.ones(2, dtype=torch.bool))


def test_mismatches_between_ranks_raise_everywhere(hvd):
    import threading
    n, r = hvd.size(), hvd.rank()
    with pytest.raises(ValueError, match="could not pickle"):
        hvd.broadcast_object(threading.Lock() if r == 0 else None, root_rank=0)
    with pytest.raises(ValueError, match=f"rank {n - 1} could not pickle"):
        hvd.allgather_object(threading.Lock() if r == n - 1 else r)
    if n == 1:
        return
    with pytest.raises(ValueError, match="rank 1: float32 shape \\[2\\]"):
        hvd.allreduce(torch.zeros(r + 1))
    with pytest.raises(ValueError, match="trailing dimensions"):
        hvd.allgather(torch.zeros(2, r + 1))
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast(torch.zeros(2), root_rank=min(r, 1))
    with pytest.raises(ValueError, match="tensor 1 \\(b\\)"):
        hvd.broadcast_parameters({"a": torch.zeros(2), "b": torch.zeros(2 + (r > 0))}, root_rank=0)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n  # still in step afterwards


# ---- join, barrier and the exchange's transport -----------------------------------------------

def test_join_and_barrier(hvd):
    last = hvd.join()
    assert 0 <= last < hvd.size() and _rows(hvd, last) == [last] * hvd.size()
    hvd.barrier()


def test_world_transport_payloads_and_byte_accounting(hvd):
    n, r = hvd.size(), hvd.rank()
    t = hvd.world_transport()
    assert t.name == "mpi" and (t.rank, t.size) == (r, n)
    assert MPI.Comm.Compare(t.comm, hvd.job_comm()) == MPI.CONGRUENT  # a separate duplicate
    sent0, received0 = t.stats.bytes_sent, t.stats.bytes_received
    sent = received = 0
    for root in range(n):
        out = t.gather(np.full(r + root, r, dtype=np.uint8), root)
        sent += r + root + 8
        if r == root:
            assert [x.tolist() for x in out] == [[k] * (k + root) for k in range(n)]
            received += sum(k + root + 8 for k in range(n))
        else:
            assert out is None
        got = t.broadcast(np.arange(5 + root, dtype=np.uint8) if r == root else None, root)
        assert got.tolist() == list(range(5 + root))
        sent += 5 + root + 8 if r == root else 0
        received += 5 + root + 8
    assert (t.stats.bytes_sent - sent0, t.stats.bytes_received - received0) == (sent, received)


# ---- the tensor API's timeout (HVD_SLIM_TIMEOUT) ---------------------------------------------

def test_a_collective_a_rank_skips_times_out_naming_it(hvd):
    """On a private communicator: the last rank arrives only after the others have timed out
    (and their roll call found it absent), then completes the abandoned collective so the test
    leaves nothing pending. The whole job launch is in test_tier_mpi.py."""
    import re
    from hvd_slim.transport import mpi_api
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        return
    comm, late = MPI.COMM_WORLD.Dup(), n - 1
    api = mpi_api.MpiCollectives(comm)
    buf = np.ones(4)
    if r != late:
        with api.watch(2.0, "allreduce of 'probe'"):
            with pytest.raises(hvd.TransportTimeout) as info:
                api.allreduce_inplace(buf, "sum")
        msg = str(info.value)
        m = re.match(rf"rank {r}: allreduce of 'probe' timed out after 2 s in MPI Iallreduce "
                     r"\(collective #1 on this communicator\): rank\(s\) ([\d, ]+) did not arrive$",
                     msg)
        assert m and str(late) in m.group(1).split(", "), msg
        with pytest.raises(hvd.TransportError, match="unusable after an earlier timeout"):
            api.barrier()   # retired: refuses at once instead of mismatching
    hvd.barrier()
    if r == late:   # join late: the others' abandoned request completes; read their roll calls
        api.allreduce_inplace(buf, "sum")
        for j in range(n - 1):
            comm.Recv(np.empty(256, np.uint8), source=j, tag=mpi_api._TAG_ROLL_CALL)
    hvd.barrier()
    if r != late:
        for item in api.retired[1]:
            if isinstance(item, MPI.Request):
                item.Wait()
    assert buf.tolist() == [n] * 4
    comm.Free()


def test_collectives_under_a_short_timeout_still_complete(hvd, monkeypatch):
    monkeypatch.setenv("HVD_SLIM_TIMEOUT", "30")
    n = hvd.size()
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [n, n]
    assert hvd.allgather(torch.ones(1)).tolist() == [1.0] * n
    assert hvd.broadcast_object("x", root_rank=n - 1) == "x"
    hvd.barrier()
    monkeypatch.setenv("HVD_SLIM_TIMEOUT", "soon")
    with pytest.raises(hvd.ConfigError, match="HVD_SLIM_TIMEOUT"):
        hvd.barrier()   # raised before any collective, on every rank alike


def test_an_average_divides_by_the_size_exactly(hvd):
    """Average is the sum divided by size(), not multiplied by 1/size(): (x + x) / 3 must come
    out as that closed form (Horovod's join tests compare with 0 tolerance)."""
    r, n = hvd.rank(), hvd.size()
    x = torch.linspace(-7.3, 9.1, 97, dtype=torch.float32)
    mine = torch.zeros_like(x) if r == 0 else x
    got = hvd.allreduce(mine, op=hvd.Average)
    want = (x * (n - 1)) / n
    if n <= 4:   # up to 3 equal addends the sum is exact in any order
        assert torch.equal(got, want)
    else:
        assert torch.allclose(got, want, rtol=1e-6)
