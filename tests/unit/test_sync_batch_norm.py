"""SyncBatchNorm in one process: its argument and input checks, the paths that communicate
nothing (eval mode, a single rank), and the synchronized path's arithmetic with the collectives
replaced by one-rank stand-ins that record what they were passed. The cross-rank behaviour is
tested under mpirun in tests/distributed/test_sync_batch_norm.py."""
from __future__ import annotations

import inspect
from typing import Any, Dict, List

import pytest
import torch
from torch.nn.modules.batchnorm import _BatchNorm

import hvd_slim
from hvd_slim.api import sync_batch_norm

BATCH_NORMS = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d,
               5: torch.nn.BatchNorm3d}
SHAPES = [(6, 3), (4, 3, 5), (3, 3, 2, 4), (2, 3, 2, 2, 3)]


def _pair(dim: int, **kwargs: Any):
    torch.manual_seed(0)
    ref = BATCH_NORMS[dim](3, **kwargs).double()
    sync = hvd_slim.SyncBatchNorm(3, **kwargs).double()
    if ref.affine:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-1, 1)
        sync.load_state_dict(ref.state_dict())
    return sync, ref


def test_is_a_batch_norm_with_horovods_signature() -> None:
    assert issubclass(hvd_slim.SyncBatchNorm, _BatchNorm) and "SyncBatchNorm" in hvd_slim.__all__
    params = list(inspect.signature(hvd_slim.SyncBatchNorm).parameters)
    assert params[:6] == ["num_features", "eps", "momentum", "affine", "track_running_stats",
                          "process_set"]
    bn = hvd_slim.SyncBatchNorm(4, process_set=None, dtype=torch.float64)
    assert bn.running_var.dtype == torch.float64 and bn.weight.shape == (4,)


@pytest.mark.parametrize("bad,error,match", [
    (0, ValueError, "num_features=0 must be at least 1"),
    (-2, ValueError, "num_features=-2 must be at least 1"),
    (3.0, TypeError, "num_features must be an int.*got float"),
    (True, TypeError, "num_features must be an int.*got bool"),
    ("3", TypeError, "num_features must be an int.*got str"),
])
def test_bad_num_features(bad: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        hvd_slim.SyncBatchNorm(bad)


@pytest.mark.parametrize("shape", [(3,), (2, 3, 1, 1, 1, 1)])
@pytest.mark.parametrize("training", [True, False])
def test_input_dims_outside_2_to_5_raise(shape: tuple, training: bool) -> None:
    bn = hvd_slim.SyncBatchNorm(3).train(training)
    with pytest.raises(ValueError, match=rf"expected a 2D, 3D, 4D or 5D input \(N, C, \.\.\.\), "
                                         rf"got a {len(shape)}D input"):
        bn(torch.randn(shape))


def test_wrong_channel_count_raises() -> None:
    with pytest.raises(ValueError, match=r"expected 3 channels .* got shape \[2, 4, 5\]"):
        hvd_slim.SyncBatchNorm(3).eval()(torch.randn(2, 4, 5))


def test_training_before_init_says_to_init() -> None:
    with pytest.raises(ValueError, match=r"use hvd.init\(\)"):
        hvd_slim.SyncBatchNorm(3)(torch.randn(4, 3))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{len(s)}d")
def test_eval_is_batch_norm_without_init(shape: tuple) -> None:
    sync, ref = _pair(len(shape))
    with torch.no_grad():
        ref.running_mean.uniform_(-1, 1)
        ref.running_var.uniform_(0.5, 2)
    sync.load_state_dict(ref.state_dict())
    x = torch.randn(shape, dtype=torch.float64)
    assert torch.allclose(sync.eval()(x), ref.eval()(x), atol=1e-12)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_one_rank_falls_back_to_batch_norm(monkeypatch: pytest.MonkeyPatch, momentum: Any) -> None:
    monkeypatch.setattr(sync_batch_norm.basics, "size", lambda: 1)
    monkeypatch.setattr(sync_batch_norm, "_SyncBatchNormFn", None)   # must not be reached
    sync, ref = _pair(4, momentum=momentum)
    for _ in range(2):
        x = torch.randn(3, 3, 2, 4, dtype=torch.float64)
        assert torch.allclose(sync(x), ref(x), atol=1e-12)
    assert torch.allclose(sync.running_var, ref.running_var, atol=1e-12)


@pytest.fixture
def one_rank_collectives(monkeypatch: pytest.MonkeyPatch) -> List[Dict[str, Any]]:
    """The synchronized path on a pretend 2-rank job whose collectives act as if this rank were
    alone; returns the keyword arguments of every collective call."""
    calls: List[Dict[str, Any]] = []

    def fake(tensor: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        calls.append(kwargs)
        return tensor.clone()

    monkeypatch.setattr(sync_batch_norm.basics, "size", lambda: 2)
    monkeypatch.setattr(sync_batch_norm, "allgather", fake)
    monkeypatch.setattr(sync_batch_norm, "allreduce", fake)
    return calls


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("affine,momentum", [(True, 0.1), (False, None)])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{len(s)}d")
def test_synchronized_arithmetic_is_batch_norms(one_rank_collectives: list, shape: tuple,
                                                affine: bool, momentum: Any, dtype: torch.dtype,
                                                tol: float) -> None:
    sync, ref = _pair(len(shape), affine=affine, momentum=momentum)
    sync, ref = sync.to(dtype), ref.to(dtype)
    for step in range(2):
        x = (torch.randn(shape, dtype=torch.float64) * 3 + 1).to(dtype)
        grad_out = torch.randn(shape, dtype=dtype)
        xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        ys, yr = sync(xs), ref(xr)
        ys.backward(grad_out)
        yr.backward(grad_out)
        assert ys.dtype == dtype and torch.allclose(ys, yr, atol=tol)
        assert torch.allclose(xs.grad, xr.grad, atol=tol)
        for a, b in [(sync.running_mean, ref.running_mean), (sync.running_var, ref.running_var)] + (
                [(sync.weight.grad, ref.weight.grad), (sync.bias.grad, ref.bias.grad)] if affine else []):
            assert torch.allclose(a, b, atol=tol)
    assert len(one_rank_collectives) == 4   # per step: the statistics' allgather, the sums' allreduce


def test_process_set_and_sum_reach_the_collectives(one_rank_collectives: list) -> None:
    marker = object()
    bn = hvd_slim.SyncBatchNorm(3, process_set=marker)
    bn(torch.randn(4, 3, requires_grad=True)).sum().backward()
    assert [c["process_set"] for c in one_rank_collectives] == [marker, marker]
    assert one_rank_collectives[1]["op"] == hvd_slim.Sum


def test_gradcheck_of_the_synchronized_path(one_rank_collectives: list) -> None:
    bn = hvd_slim.SyncBatchNorm(3, track_running_stats=False).double()
    x = torch.randn(5, 3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(bn, (x,))
