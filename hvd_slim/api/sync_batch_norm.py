"""Horovod's ``SyncBatchNorm``: batch normalization whose training-mode statistics are those of
the global batch, the concatenation of every rank's local batch.

Forward allgathers each rank's (count, mean, sum of squared deviations) per channel and merges
them with the pairwise variance formula, which stays accurate where a global sum of squares
would cancel; counts let ranks hold different batch sizes (an empty local batch included).
Backward allreduces the two per-channel gradient sums the input gradient depends on, so each
rank's input gradient equals that of one BatchNorm over the whole global batch. The weight and
bias gradients stay local, as in Horovod: the optimizer's exchange sums or averages them.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from ..runtime import basics
from .collectives import allgather, allreduce
from .ops import Sum

__all__ = ["SyncBatchNorm"]

_MIN_DIM, _MAX_DIM = 2, 5


def _reduced_dims(x: torch.Tensor) -> List[int]:
    """Every dimension but the channels (dim 1): the ones a channel's statistics run over."""
    return [0] + list(range(2, x.dim()))


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``v`` of shape (C,) shaped to broadcast against ``x`` of shape (N, C, ...)."""
    return v.view(1, -1, *([1] * (x.dim() - 2)))


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    # Half-precision statistics lose too much; float32 and float64 are kept as they are.
    return torch.promote_types(x.dtype, torch.float32)


def _global_stats(x: torch.Tensor, eps: float, process_set: Any) -> Tuple[torch.Tensor, ...]:
    """The global batch's per-channel mean, biased variance and 1/sqrt(var + eps), and its
    number of values per channel (a float64 scalar), from one allgather."""
    channels, dims = x.shape[1], _reduced_dims(x)
    count = x.numel() // channels
    # Merged in float64: the stats are 2C+1 numbers, so the precision costs nothing.
    xs = x.to(torch.float64)
    if count:
        mean = xs.mean(dims)
        m2 = (xs - _per_channel(mean, xs)).square().sum(dims)
    else:  # an empty local batch contributes nothing, but still takes part in the collective
        mean = m2 = xs.new_zeros(channels)
    local = torch.cat([xs.new_tensor([float(count)]), mean, m2]).view(1, -1)
    rows = allgather(local, name="SyncBatchNorm statistics", process_set=process_set)
    counts, means, m2s = rows[:, :1], rows[:, 1:channels + 1], rows[:, channels + 1:]
    total = counts.sum()
    if total <= 1:
        raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel when training, got "
                         f"{int(total)} over all ranks (input shape {list(x.shape)} here); use a "
                         f"larger batch or eval() mode")
    g_mean = (counts * means).sum(0) / total
    g_m2 = m2s.sum(0) + (counts * (means - g_mean).square()).sum(0)
    var = g_m2 / total
    return g_mean, var, (var + eps).rsqrt(), total


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], running_mean: Optional[torch.Tensor],
                running_var: Optional[torch.Tensor], eps: float, momentum: float,
                process_set: Any) -> torch.Tensor:
        mean, var, invstd, total = _global_stats(x, eps, process_set)
        if running_mean is not None and running_var is not None:
            # BatchNorm's running variance is the unbiased one, here over the global count.
            unbiased = var * (total / (total - 1))
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        work = _work_dtype(x)
        mean, invstd = mean.to(work), invstd.to(work)
        y = (x.to(work) - _per_channel(mean, x)) * _per_channel(invstd, x)
        if weight is not None:
            y = y * _per_channel(weight.to(work), x)
        if bias is not None:
            y = y + _per_channel(bias.to(work), x)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total, ctx.process_set = float(total), process_set
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        dims, work = _reduced_dims(x), mean.dtype
        g = grad_out.to(work)
        xhat = (x.to(work) - _per_channel(mean, x)) * _per_channel(invstd, x)
        sum_g, sum_gx = g.sum(dims), (g * xhat).sum(dims)
        grad_w = sum_gx.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = sum_g.to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] \
            else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            # The input gradient needs these two sums over the global batch, not the local one.
            sums = allreduce(torch.cat([sum_g, sum_gx]), op=Sum,
                             name="SyncBatchNorm gradient sums", process_set=ctx.process_set)
            mean_g, mean_gx = (s / ctx.total for s in sums.chunk(2))
            scale = invstd if weight is None else invstd * weight.to(work)
            grad_x = _per_channel(scale, x) * (g - _per_channel(mean_g, x)
                                               - xhat * _per_channel(mean_gx, x))
            grad_x = grad_x.to(x.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the global batch of every rank (Horovod's ``SyncBatchNorm``).

    In training mode the mean and variance are those of the concatenation of every rank's
    local batch (local batch sizes may differ), the running statistics are updated with the
    global mean and unbiased variance, and the input gradient is that of one BatchNorm over
    the whole global batch. Forward and backward are collectives: every rank must call them in
    the same order. The weight and bias gradients are this rank's own, to be averaged by
    ``DistributedOptimizer`` like any other gradient. In eval mode with running statistics,
    and in training on a single rank, it is ``torch.nn.BatchNorm`` and communicates nothing.
    Inputs are (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W).

    Args:
        num_features: C, the number of channels (a positive int).
        eps: Added to the variance for numerical stability (default 1e-5).
        momentum: The weight of a batch's statistics in the running ones (default 0.1);
            None keeps a cumulative average instead.
        affine: Whether the module has a learnable per-channel weight and bias (default True).
        track_running_stats: Whether running statistics are kept and used in eval mode
            (default True); without them eval mode also normalizes with global batch statistics.
        process_set: The ranks to synchronize over, passed on to the collectives; hvd_slim
            supports only None (every rank), other values raise ValueError in forward.
        device: Where the parameters and buffers are created (default: torch's default).
        dtype: Their dtype (default: torch's default).

    Raises:
        TypeError: ``num_features`` is not an int.
        ValueError: ``num_features`` is below 1.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_set: Any = None,
                 *, device: Any = None, dtype: Optional[torch.dtype] = None) -> None:
        if isinstance(num_features, bool) or not isinstance(num_features, int):
            raise TypeError(f"SyncBatchNorm: num_features must be an int (the number of channels, "
                            f"C of an (N, C, ...) input), got {type(num_features).__name__}")
        if num_features < 1:
            raise ValueError(f"SyncBatchNorm: num_features={num_features} must be at least 1 (the "
                             f"number of channels, C of an (N, C, ...) input)")
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if not _MIN_DIM <= input.dim() <= _MAX_DIM:
            raise ValueError(f"SyncBatchNorm: expected a 2D, 3D, 4D or 5D input (N, C, ...), got a "
                             f"{input.dim()}D input of shape {list(input.shape)}")
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm: expected {self.num_features} channels (dim 1 of the "
                             f"input), got shape {list(input.shape)}; num_features must match C")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input`` with global batch statistics (training) or running ones (eval).

        Collective in training mode on more than one rank (and in eval mode without running
        statistics): every rank calls it, in the same order, with the same C and trailing
        dimensions; N may differ and may be 0 on some ranks.

        Args:
            input: An (N, C, ...) tensor with 2 to 5 dimensions.

        Returns:
            The normalized tensor, of the input's shape and dtype.

        Raises:
            ValueError: the input's dimensions or channels do not fit, the global batch holds
                a single value per channel in training, or ``process_set`` is not supported.
        """
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:   # a cumulative average of every batch so far
                factor = 1.0 / float(self.num_batches_tracked)
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        track = self.training and self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None
        if self.process_set is None and basics.size() == 1:
            # Nothing to synchronize with: the local batch is the global one.
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, True,
                                factor, self.eps)
        return _SyncBatchNormFn.apply(input, self.weight, self.bias, running_mean, running_var,
                                      self.eps, factor, self.process_set)
