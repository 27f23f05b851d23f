"""PowerSGD through torch DDP's communication hook, as a peer in the convergence study.

``--method powersgd`` (with ``rank`` 1 or 4) wraps the model in ``DistributedDataParallel`` over
a Gloo group that hvd_slim's rendezvous starts on the MPI job, and registers torch's
``powerSGD_hook`` (error feedback and warm start on, as the PowerSGD paper runs it; plain
allreduce for the first two steps, which DDP needs to settle its buckets). The training loop
then drives the DDP module: the hook reduces gradients inside ``backward()``, and ``step()``
is the wrapped optimizer's own.

Bytes are counted where the hook hands tensors to ``torch.distributed.all_reduce`` (P and Q
factors, and the tensors PowerSGD leaves uncompressed), then charged as a ring allreduce sends
and receives them: ``2 (N - 1) / N`` of those bytes each way per rank.
"""
from __future__ import annotations

from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.nn as nn

from .ddp_hook import HookedDDP, ddp_on_mpi

_counted = {"bytes": 0}
_original_all_reduce = dist.all_reduce


def _counting_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    _counted["bytes"] += tensor.numel() * tensor.element_size()
    return _original_all_reduce(tensor, *args, **kwargs)


class PowerSGDOptimizer(HookedDDP):
    """torch's PowerSGD hook on DDP's model (every parameter in one bucket)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, rank: int,
                 size: int) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # One bucket: PowerSGD over Gloo fails with "Received data size doesn't match expected
        # size" when parameters are spread over several (measured at 4 ranks).
        super().__init__(optimizer, ddp_on_mpi(model, bucket_cap_mb=nbytes / 2 ** 20 + 1))
        self.size = size
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                   start_powerSGD_iter=2, use_error_feedback=True,
                                   warm_start=True, random_seed=0)
        self.module.register_comm_hook(state, psgd.powerSGD_hook)
        dist.all_reduce = _counting_all_reduce
        self._base = _counted["bytes"]
        self._grad_bytes = nbytes

    def comm_stats(self) -> Dict[str, float]:
        """Cumulative bytes of this rank, modelled as a ring allreduce of what the hook handed
        to ``all_reduce`` (see the module docstring)."""
        handed = _counted["bytes"] - self._base
        ring = 2 * (self.size - 1) / self.size * handed if self.size > 1 else 0.0
        return {"steps": self.steps, "bytes_pushed": ring, "bytes_pulled": ring,
                "dense_bytes": float(self.steps * self._grad_bytes), "handed_bytes": handed,
                "modelled": True}

    def close(self) -> None:
        """Stop counting (the next run builds its own)."""
        dist.all_reduce = _original_all_reduce
