"""The exchange's transport over a torch.distributed process group.

With the default group (``process_group=None``, DDP's own default), the hook exchanges on a
private group over the same ranks, made at the first bucket, where every rank is at the same
point: DDP makes collectives of its own on its group during backward (the unused-parameter map
with ``find_unused_parameters=True``), which must never interleave differently on two ranks with
the hook's, run on their own thread. A group the user gives is used as it is, and the hook's
exchanges then run in DDP's thread.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch

from ..runtime import torch_world
from ..transport.torch_dist import TorchDistTransport


def group_transport(group: Any, device: torch.device) -> Tuple[TorchDistTransport, bool]:
    """A transport for gradients on ``device``: Gloo frames on the host, NCCL's on this rank's
    CUDA device; and whether it is a private group (so its exchanges may run on a thread of
    their own). Collective over the group's ranks when ``group`` is None."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("hvd_slim.ddp: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group() (torchrun sets up its "
                           "environment) before the first backward pass")
    backend = "nccl" if device.type == "cuda" else "gloo"
    have = str(dist.get_backend(group)).lower()
    if backend not in have:
        raise ValueError(f"hvd_slim.ddp: gradients on {device} need a {backend!r} process "
                         f"group, and this one's backend is {have!r}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"hvd_slim.ddp: rank {dist.get_rank()} is not a member of the "
                         f"SlimState's process_group; build the SlimState with the DDP model's "
                         f"own group (DistributedDataParallel(process_group=...))")
    tmo = torch_world.timeout()
    private = group is None
    if private:
        group = dist.new_group(backend=backend, timeout=tmo)
    frames = torch.device("cpu") if backend == "gloo" else \
        torch.device("cuda", torch.cuda.current_device())
    return TorchDistTransport(group, backend, frames, rank, dist.get_world_size(group), tmo,
                              (lambda: torch_world.destroy_group(group)) if private else None
                              ), private
