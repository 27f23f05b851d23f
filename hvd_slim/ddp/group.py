"""The exchange's transport over a torch.distributed process group (DDP's, by default)."""
from __future__ import annotations

from typing import Any

import torch

from ..runtime import torch_world
from ..transport.torch_dist import TorchDistTransport


def group_transport(group: Any) -> TorchDistTransport:
    """A transport over ``group`` (None: the default group) on its own backend: Gloo frames on
    the host, NCCL's on this rank's CUDA device. The group stays the caller's: closing the
    transport leaves it alone."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("hvd_slim.ddp: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group() (torchrun sets up its "
                           "environment) before the first backward pass")
    backend = str(dist.get_backend(group)).lower()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"hvd_slim.ddp: the process group's backend is {backend!r}; the "
                         f"Slim-DP hook runs on 'gloo' or 'nccl'")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"hvd_slim.ddp: rank {dist.get_rank()} is not a member of the "
                         f"SlimState's process_group; build the SlimState with the DDP model's "
                         f"own group (DistributedDataParallel(process_group=...))")
    device = torch.device("cpu") if backend == "gloo" else \
        torch.device("cuda", torch.cuda.current_device())
    return TorchDistTransport(group, backend, device, rank, dist.get_world_size(group),
                              torch_world.timeout())
