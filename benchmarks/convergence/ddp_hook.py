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


class SlimHookOptimizer:
    """The wrapped optimizer plus the DDP module (``.module``) that carries the hook."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module,
                 density: Optional[float], slim_kwargs: Dict[str, Any]) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        from hvd_slim.ddp import SlimState
        from hvd_slim.optim.rendezvous import torch_transport
        torch_transport("gloo", torch.device("cpu"))  # a Gloo group over this MPI job
        self.optimizer = optimizer
        kwargs = dict(slim_kwargs)
        cap = kwargs.pop("ddp_bucket_cap_mb", None)
        self.module = DDP(model) if cap is None else DDP(model, bucket_cap_mb=float(cap))
        if density is not None:
            kwargs["density"] = density
        adam = type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
        self.state = SlimState(optimizer=optimizer if adam else None, **kwargs)
        self.state.register(self.module)

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.optimizer.step()

    def comm_stats(self) -> Dict[str, Any]:
        return self.state.comm_stats()
