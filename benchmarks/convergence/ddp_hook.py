"""hvd_slim's DDP communication hook as a method of the convergence study (``--method
slim-hook``): the same run as ``slim`` (``DistributedOptimizer``), through the way a DDP script
takes Slim-DP instead.

The model is wrapped in ``DistributedDataParallel`` with DDP's own buckets, over a Gloo group
that hvd_slim's rendezvous starts on the MPI job, and ``SlimState(...).register(ddp)`` takes the
run's Slim-DP keywords; under torch's Adam and AdamW the state takes the optimizer, so each
rank's Adam update travels, as ``DistributedOptimizer``'s default does. The training loop then
drives the DDP module (backward runs the hook), and ``step()`` is the wrapped optimizer's, which
the state has taken over under Adam. Bytes are the state's own ``comm_stats()``.

``ddp_bucket_cap_mb`` among the run's keywords is DDP's ``bucket_cap_mb``, not a Slim-DP keyword
(the model's size or more: every parameter in one bucket, one exchange a step).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn


class HookedDDP:
    """A DDP peer of the study: the wrapped optimizer, and the DDP module (``.module``) whose
    backward runs a communication hook; the training loop drives ``.module`` and steps here.

    Args:
        optimizer: The optimizer being wrapped (its ``step()`` is the step).
        module: The ``DistributedDataParallel`` model, its hook registered.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
        self.optimizer, self.module, self.steps = optimizer, module, 0

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.optimizer.step()
        self.steps += 1


def ddp_on_mpi(model: nn.Module, **ddp_kw: Any) -> nn.Module:
    """``model`` in ``DistributedDataParallel`` over a Gloo group that hvd_slim's rendezvous
    starts on this MPI job."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hvd_slim.optim.rendezvous import torch_transport
    torch_transport("gloo", torch.device("cpu"))
    return DDP(model, **ddp_kw)


class SlimHookOptimizer(HookedDDP):
    """hvd_slim's hook on DDP's model, with the run's Slim-DP keywords."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module,
                 density: Optional[float], slim_kwargs: Dict[str, Any]) -> None:
        from hvd_slim.ddp import SlimState
        kwargs = dict(slim_kwargs)
        cap = kwargs.pop("ddp_bucket_cap_mb", None)
        super().__init__(optimizer, ddp_on_mpi(model) if cap is None else
                         ddp_on_mpi(model, bucket_cap_mb=float(cap)))
        if density is not None:
            kwargs["density"] = density
        adam = type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
        self.state = SlimState(optimizer=optimizer if adam else None, **kwargs)
        self.state.register(self.module)

    def comm_stats(self) -> Dict[str, Any]:
        return self.state.comm_stats()
