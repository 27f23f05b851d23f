"""The DDP communication hooks: ``slim_hook`` (Slim-DP, one bucket a call) and ``local_hook``
(no communication, for rounds of local steps).

No ``from __future__ import annotations`` here: DDP's ``register_comm_hook`` checks the hook's
annotations as objects (``dist.GradBucket``, ``torch.futures.Future[torch.Tensor]``).
"""
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:   # state.py registers this hook (SlimState.register): no import back
    from .state import SlimState


def slim_hook(state: "SlimState", bucket: dist.GradBucket
              ) -> torch.futures.Future[torch.Tensor]:
    """Exchange one DDP gradient bucket with Slim-DP; register it with
    ``ddp_model.register_comm_hook(SlimState(), slim_hook)``.

    Args:
        state: The model's :class:`SlimState`.
        bucket: DDP's ``torch.distributed.GradBucket``.

    Returns:
        A future of the bucket's averaged update, the same bits on every rank, completed when
        the backward pass's last bucket settles them all (:meth:`SlimState.reduce`). An error
        (a rank with another model or settings, a timeout naming the silent rank, a NaN/Inf
        under ``nonfinite="raise"``) is set on the futures, so backward raises it.
    """
    return state.reduce(bucket.index(), bucket.buffer(), bucket.parameters(), bucket.is_last())


def local_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Leave DDP's gradient bucket as it is: no communication in backward, each rank keeps its
    own gradient. Registered by :func:`hvd_slim.ddp.local_optimizer` with its optimizer as
    the state, whose rounds of local steps bring the replicas back together.

    Args:
        state: The ``hvd_slim.DistributedOptimizer`` with ``local_steps > 1`` over the DDP
            model's parameters (anything else is refused at the first bucket: gradients kept
            local without it would let the replicas drift apart).
        bucket: DDP's ``torch.distributed.GradBucket``.

    Returns:
        A completed future of the bucket's own flat gradient.
    """
    config = getattr(state, "slim_config", None)
    if not getattr(state, "_hvd_slim_wrapped", False) or config is None \
            or config.local_steps <= 1:
        raise RuntimeError("hvd_slim.ddp.local_hook keeps each rank's gradient, which only an "
                           "hvd_slim.DistributedOptimizer with local_steps > 1 brings back "
                           "together; register it with hvd_slim.ddp.local_optimizer(ddp_model, "
                           "optimizer, local_steps=H), which passes that optimizer as the state")
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
