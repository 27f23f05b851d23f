"""SyncBatchNorm under mpirun, at any world size, against one torch BatchNorm over the global
batch in a single process.

Every rank builds the same seeded global batch and takes its own rows of it (rank r holds
r + 2 of them unless a test says otherwise, so the ranks' batch sizes differ), then compares its
output and input gradient with the reference's rows, the summed weight and bias gradients with
the reference's, and the running statistics with the reference's.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import pytest
import torch

C = 3
BATCH_NORMS = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d,
               5: torch.nn.BatchNorm3d}
TOL = {torch.float64: 1e-5, torch.float32: 1e-4}


def _rows_per_rank(hvd, rows: Optional[Sequence[int]] = None) -> List[int]:
    return list(rows) if rows is not None else [r + 2 for r in range(hvd.size())]


def _batch(rows: Sequence[int], tail: Tuple[int, ...], dtype: torch.dtype,
           seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The global batch and the gradient of the loss with respect to the output, the same on
    every rank; channels get different offsets and scales so every statistic matters."""
    g = torch.Generator().manual_seed(seed)
    shape = (sum(rows), C, *tail)
    offset = torch.arange(C, dtype=torch.float64).view(1, C, *([1] * len(tail)))
    x = torch.randn(shape, generator=g, dtype=torch.float64) * (1 + offset) + 3 * offset
    return x.to(dtype), torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _mine(hvd, t: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    start = sum(rows[:hvd.rank()])
    return t[start:start + rows[hvd.rank()]]


def _pair(hvd, dim: int, dtype: torch.dtype, **kwargs):
    """A SyncBatchNorm and the reference BatchNorm with the same seeded weight and bias."""
    ref = BATCH_NORMS[dim](C, **kwargs).to(dtype)
    sync = hvd.SyncBatchNorm(C, **kwargs).to(dtype)
    if ref.affine:
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            ref.weight.copy_(torch.rand(C, generator=g, dtype=torch.float64) + 0.5)
            ref.bias.copy_(torch.randn(C, generator=g, dtype=torch.float64))
            sync.weight.copy_(ref.weight)
            sync.bias.copy_(ref.bias)
    return sync, ref


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    err = (got - want).abs().max().item() if got.numel() else 0.0
    scale = 1 + (want.abs().max().item() if want.numel() else 0)   # relative to the values' size
    assert err <= tol * scale, \
        f"{what}: max abs error {err:.3g} over tolerance {tol}"


def _train_and_compare(hvd, tail: Tuple[int, ...], dtype: torch.dtype = torch.float64,
                       rows: Optional[Sequence[int]] = None, steps: int = 2, **kwargs):
    """``steps`` training steps of both modules, every result compared; returns the pair."""
    rows, tol = _rows_per_rank(hvd, rows), TOL[dtype]
    sync, ref = _pair(hvd, 2 + len(tail), dtype, **kwargs)
    for step in range(steps):
        x, grad_out = _batch(rows, tail, dtype, seed=100 + step)
        xr = x.clone().requires_grad_()
        want = ref(xr)
        want.backward(grad_out)
        xs = _mine(hvd, x, rows).clone().requires_grad_()
        y = sync(xs)
        y.backward(_mine(hvd, grad_out, rows))
        _close(y.detach(), _mine(hvd, want.detach(), rows), tol, f"step {step}: output")
        _close(xs.grad, _mine(hvd, xr.grad, rows), tol, f"step {step}: input gradient")
        if ref.affine:
            for name in ("weight", "bias"):
                summed = hvd.allreduce(getattr(sync, name).grad, op=hvd.Sum)
                _close(summed, getattr(ref, name).grad, tol, f"step {step}: {name} gradient")
                getattr(sync, name).grad, getattr(ref, name).grad = None, None
        if ref.track_running_stats:
            _close(sync.running_mean, ref.running_mean, tol, f"step {step}: running_mean")
            _close(sync.running_var, ref.running_var, tol, f"step {step}: running_var")
            assert int(sync.num_batches_tracked) == int(ref.num_batches_tracked) == step + 1
        else:
            assert sync.running_mean is None and sync.running_var is None
    return sync, ref


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("tail", [(), (5,), (2, 3), (2, 2, 3)], ids=["2d", "3d", "4d", "5d"])
def test_training_matches_batch_norm_on_the_global_batch(hvd, tail, dtype):
    _train_and_compare(hvd, tail, dtype)


@pytest.mark.parametrize("tail", [(), (2, 3)], ids=["2d", "4d"])
def test_momentum_none_keeps_a_cumulative_average(hvd, tail):
    _train_and_compare(hvd, tail, steps=3, momentum=None)


def test_affine_false(hvd):
    sync, _ = _train_and_compare(hvd, (4,), affine=False)
    assert sync.weight is None and sync.bias is None


def test_without_running_stats_eval_also_uses_global_batch_stats(hvd):
    sync, ref = _train_and_compare(hvd, (2, 3), track_running_stats=False)
    sync.eval()
    ref.eval()
    rows = _rows_per_rank(hvd)
    x, _ = _batch(rows, (2, 3), torch.float64, seed=9)
    with torch.no_grad():
        _close(sync(_mine(hvd, x, rows)), _mine(hvd, ref(x), rows), TOL[torch.float64],
               "eval output without running stats")


def test_an_empty_local_batch_takes_part(hvd):
    """Rank 0 holds no rows: it still joins both collectives and gets empty results."""
    rows = [0] + [r + 1 for r in range(1, hvd.size())]
    _train_and_compare(hvd, (3,), rows=rows)


@pytest.mark.parametrize("tail", [(), (4,), (2, 3)], ids=["2d", "3d", "4d"])
def test_eval_uses_the_running_stats_and_no_collective(hvd, tail):
    sync, ref = _train_and_compare(hvd, tail)
    sync.eval()
    ref.eval()
    # Each rank's own batch shape: eval makes no collective, so nothing has to match.
    x = torch.randn(hvd.rank() + 1, C, *[d + hvd.rank() for d in tail], dtype=torch.float64)
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys, yr = sync(xs), ref(xr)
    _close(ys, yr, 1e-12, "eval output")
    ys.sum().backward()
    yr.sum().backward()
    _close(xs.grad, xr.grad, 1e-12, "eval input gradient")
    assert int(sync.num_batches_tracked) == 2


def test_a_single_value_per_channel_raises_on_every_rank(hvd):
    sync = hvd.SyncBatchNorm(C)
    x = torch.randn(1 if hvd.rank() == 0 else 0, C)
    with pytest.raises(ValueError, match="more than 1 value per channel when training, got 1"):
        sync(x)


def test_a_model_step_through_the_optimizer(hvd):
    """A small model under DistributedOptimizer at density 1 (dense averaging) stays identical
    on every rank, running stats included, while each rank feeds different data."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, C, 3), hvd.SyncBatchNorm(C), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(C * 4 * 4, 2)).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), density=1.0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(hvd.rank())
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(hvd.rank() + 2, 2, 6, 6, generator=g, dtype=torch.float64)).square().sum().backward()
        opt.step()
    state = torch.cat([t.reshape(-1).double() for t in model.state_dict().values()])
    gathered = hvd.allgather(state.view(1, -1))
    assert torch.equal(gathered, state.expand_as(gathered)), "ranks diverged"
