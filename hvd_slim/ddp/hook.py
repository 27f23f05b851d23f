"""``slim_hook``: the DDP communication hook, one bucket a call.

No ``from __future__ import annotations`` here: DDP's ``register_comm_hook`` checks the hook's
annotations as objects (``dist.GradBucket``, ``torch.futures.Future[torch.Tensor]``).
"""
from typing import TYPE_CHECKING

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
