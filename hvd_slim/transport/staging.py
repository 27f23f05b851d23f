"""Tensor payloads over transports that move host buffers: the staging of device tensors
through pinned (page-locked) host memory, and the default tensor collectives built on it.

A transport that supports device payloads (:meth:`Transport.device_payloads`) takes and returns
uint8 tensors on the caller's device. Those that cannot move device memory themselves (MPI
without CUDA-aware support, Gloo) copy each message once to pinned host memory (a DMA copy,
about twice the bandwidth of pageable memory, and needed by the DMA engine anyway) and copy
received messages back once, instead of the exchange converting every section to numpy.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import numpy as np
import torch

# The numpy collectives the staged ones run over (a transport's ``gather`` and ``broadcast``),
# taken as callables so that this module needs nothing from base.py, which imports it.
NumpyGather = Callable[[np.ndarray, int, Optional[int]], Optional[List[np.ndarray]]]
NumpyBroadcast = Callable[[Optional[np.ndarray], int, Optional[int]], np.ndarray]


def host_buffer(n: int, pinned: bool) -> torch.Tensor:
    """An uninitialised uint8 host tensor of ``n`` bytes; page-locked when ``pinned`` and CUDA
    is usable (torch's caching host allocator recycles freed pinned blocks, so this is cheap
    from the second step on)."""
    pin = pinned and torch.cuda.is_available()
    return torch.empty(n, dtype=torch.uint8, pin_memory=pin)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` (1-D uint8) in host memory: itself when already there, else one copy into a
    pinned buffer (synchronous: the host reads it next)."""
    if t.device.type == "cpu":
        return t.contiguous()
    out = host_buffer(t.numel(), pinned=True)
    out.copy_(t)
    return out


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A received host tensor on ``device`` (no copy when that is the host). Synchronous, so
    the host buffer may be reused at once."""
    return t if torch.device(device).type == "cpu" else t.to(device)


def gather_staged(gather: NumpyGather, payload: torch.Tensor, root: int,
                  bound: Optional[int] = None) -> Optional[List[torch.Tensor]]:
    """:meth:`Transport.gather_tensor` over the transport's numpy ``gather``."""
    out = gather(to_host(payload).numpy(), root, bound)
    if out is None:
        return None
    return [to_device(torch.from_numpy(b), payload.device) for b in out]


def broadcast_staged(broadcast: NumpyBroadcast, payload: Optional[torch.Tensor], root: int,
                     bound: Optional[int], device: torch.device) -> torch.Tensor:
    """:meth:`Transport.broadcast_tensor` over the transport's numpy ``broadcast``."""
    host = None if payload is None else to_host(payload).numpy()
    return to_device(torch.from_numpy(broadcast(host, root, bound)), device)
