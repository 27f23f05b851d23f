"""Issue 6 under mpirun (every rank runs these tests in the same order): ranks that disagree,
NaN/Inf gradients, checkpoints through files, flush conservation and a data path that never
unpickles. The whole-job failures (raise, SIGKILL, hang) are launched by
tests/unit/test_reliability_launch.py.
"""
import hashlib
import pickle

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hvd_slim as hvd
from hvd_slim.exchange import ExchangeError, NonFiniteGradientError

COMM = MPI.COMM_WORLD


def rank():
    return hvd.rank()


def size():
    return hvd.size()


def net(hidden=64):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(48, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 4))


def wrap(model, lr=0.05, momentum=0.9, **kw):
    kw.setdefault("min_compress_numel", 1000)
    kw.setdefault("density", 0.02)
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
                                    named_parameters=model.named_parameters(), **kw)


def train(model, opt, steps, poison=None):
    """``poison``: {(rank, step): value} written into one gradient entry of '0.weight'."""
    out = []
    for t in steps:
        g = torch.Generator().manual_seed(7919 * rank() + t)
        x, y = torch.randn(16, 48, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if poison and (rank(), t) in poison:
            model[0].weight.grad.view(-1)[3] = poison[(rank(), t)]
        out.append(opt.step())
    return out


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def same_on_every_rank(value):
    values = COMM.allgather(value)
    assert all(v == values[0] for v in values), values
    return values[0]


def hash_of(t):
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def first_step_error(model, **kw):
    opt = wrap(model, **kw)
    with pytest.raises(ExchangeError) as info:
        train(model, opt, range(1))
    return same_on_every_rank(str(info.value))


# --- mismatch across ranks ---------------------------------------------------------------------
def test_different_models_raise_the_same_error_everywhere():
    last = size() - 1
    msg = first_step_error(net(hidden=80 if rank() == last else 64))
    others = ", ".join(map(str, range(last)))
    assert f"Parameter '0.bias': shape (64,) float32 on rank{'s' if last > 1 else ''} {others} " \
           f"vs. shape (80,) float32 on rank {last}" in msg, msg


def test_a_different_density_names_the_field_and_the_ranks():
    msg = first_step_error(net(), density=0.05 if rank() == 1 else 0.02)
    assert "Config field 'density': 0.02 on rank" in msg and "0.05 on rank 1." in msg, msg


def test_a_parameter_frozen_on_one_rank_only():
    model = net()
    if rank() == 0:
        model[2].weight.requires_grad_(False)
    msg = first_step_error(model)
    assert "Parameter '2.weight': frozen (requires_grad=False), shape (4, 64) float32 on rank 0 " \
           "vs. shape (4, 64) float32 on rank" in msg, msg


def test_after_a_mismatch_the_next_optimizer_works():
    model = net()
    opt = wrap(model)
    train(model, opt, range(3))
    same_on_every_rank(hash_of(flat(model)))


# --- NaN/Inf -----------------------------------------------------------------------------------
def test_nonfinite_raise_names_the_rank_and_tensor_and_changes_nothing():
    model = net()
    opt = wrap(model, nonfinite="raise")
    train(model, opt, range(2))
    before = hash_of(flat(model))
    with pytest.raises(NonFiniteGradientError) as info:
        train(model, opt, [2], poison={(size() - 1, 2): float("nan")})
    msg = same_on_every_rank(str(info.value))
    assert f"rank {size() - 1}: NaN/Inf in the gradient of '0.weight'" in msg, msg
    assert hash_of(flat(model)) == before
    train(model, opt, range(3, 5))
    same_on_every_rank(hash_of(flat(model)))


def test_nonfinite_skip_skips_everywhere_and_equals_a_run_without_that_step():
    model, ref = net(), net()
    opt, ref_opt = wrap(model, nonfinite="skip"), wrap(ref, nonfinite="skip")
    results = train(model, opt, range(6), poison={(0, 2): float("inf")})
    train(ref, ref_opt, [0, 1, 3, 4, 5])
    assert results[2] is None and opt.comm_stats()["skipped_steps"] == 1
    assert torch.equal(flat(model), flat(ref))
    same_on_every_rank(hash_of(flat(model)))
    assert "step 2 skipped on every rank" in same_on_every_rank(
        opt.comm_stats()["last_skip_reason"])


def test_nonfinite_propagate_keeps_replicas_bitwise_identical():
    model = net()
    opt = wrap(model, nonfinite="propagate", density=1.0)
    train(model, opt, range(3), poison={(1, 1): float("nan")})
    assert torch.isnan(flat(model)).any()
    same_on_every_rank(hash_of(flat(model)))


# --- checkpoints -------------------------------------------------------------------------------
def test_save_at_t_restart_from_files_equals_the_uninterrupted_run_at_2t(tmp_path):
    """Every rank saves its model and optimizer (residuals; the server's state on rank 0) to its
    own files; brand-new objects load them (weights_only) and go on: bitwise equal at 2T."""
    T = 5
    full = net()
    full_opt = wrap(full)
    train(full, full_opt, range(2 * T))

    model = net()
    opt = wrap(model)
    train(model, opt, range(T))
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    del model, opt

    model = net()
    opt = wrap(model)
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    train(model, opt, range(T, 2 * T))
    assert torch.equal(flat(model), flat(full))
    assert opt._exchange.residual_norm() == full_opt._exchange.residual_norm() > 0
    same_on_every_rank(hash_of(flat(model)))


def test_another_ranks_checkpoint_is_refused_without_changing_anything():
    model = net()
    opt = wrap(model)
    train(model, opt, range(2))
    states = COMM.allgather(opt.state_dict())   # test-only: trusted ranks
    before = hash_of(flat(model)), opt._exchange.residual_norm()
    with pytest.raises(ValueError, match=rf"residuals of rank {(rank() + 1) % size()} of "
                                         rf"{size()}; this is rank {rank()}"):
        opt.load_state_dict(states[(rank() + 1) % size()])
    assert (hash_of(flat(model)), opt._exchange.residual_norm()) == before
    train(model, opt, range(2, 4))
    same_on_every_rank(hash_of(flat(model)))


def test_flush_then_checkpoint_conserves_every_gradient_exactly(tmp_path):
    """op=Sum, lr=1, integer parameters and gradients: every sum is exact, so the checkpoint
    taken after flush() equals p0 - (all gradients of all ranks) bit for bit."""
    model = net()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.round(p * 64))
    p0 = flat(model).clone()
    opt = wrap(model, lr=1.0, momentum=0.0, op=hvd.Sum, density=0.01)
    total = torch.zeros_like(p0)
    for t in range(6):
        g = torch.Generator().manual_seed(31 * rank() + t)
        grads = torch.randint(-8, 9, p0.shape, generator=g).float()
        total += grads
        opt.zero_grad()
        offset = 0
        for p in model.parameters():
            p.grad = grads[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        opt.step()
    assert opt._exchange.residual_norm() > 0
    opt.flush()
    assert opt._exchange.residual_norm() == 0.0
    torch.save(model.state_dict(), tmp_path / "model.pt")
    restored = net()
    restored.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    everything = torch.from_numpy(np.asarray(COMM.allreduce(total.numpy(), op=MPI.SUM)))
    assert torch.equal(flat(restored), p0 - everything)


# --- security ----------------------------------------------------------------------------------
def test_the_data_path_never_unpickles(monkeypatch):
    """Training steps, a flush and the first-step handshake run with every unpickler disabled
    (Python's pickle and mpi4py's): only raw bytes travel."""
    def refuse(*_a, **_k):
        raise AssertionError("the exchange unpickled something")

    # MPI.pickle.dumps/loads are bound to MPI.pickle itself: restore from the pickle module's.
    real = pickle.dumps, pickle.loads
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    MPI.pickle.__init__(refuse, refuse)
    try:
        model = net()
        opt = wrap(model, nonfinite="skip")
        train(model, opt, range(3), poison={(0, 1): float("nan")})
        opt.flush()
    finally:
        MPI.pickle.__init__(*real)
        monkeypatch.undo()
    assert opt.comm_stats()["skipped_steps"] == 1
    same_on_every_rank(hash_of(flat(model)))
