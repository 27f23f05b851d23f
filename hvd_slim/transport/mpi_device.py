"""Tensor payloads over MPI (:meth:`MpiTransport.gather_tensor` / ``broadcast_tensor``).

mpi4py takes torch tensors directly (through DLPack), host or device memory alike. Device memory
is handed to MPI only when the library says it can read it: Open MPI's
``MPIX_Query_cuda_support()`` (or mpi4py's ``MPI.Query_cuda_support`` where a version has it)
returning 1. Otherwise, and when neither can be asked, each message is staged through pinned host
memory: one device-to-host copy before sending and one host-to-device copy after receiving,
instead of the exchange converting every section to numpy.
"""
from __future__ import annotations

import ctypes
from typing import List, Optional

import torch
from mpi4py import MPI

from .mpi_comm import mpi_errors
from .staging import host_buffer, to_device, to_host

_CUDA_AWARE: Optional[bool] = None


def cuda_aware() -> bool:
    """Whether this MPI library reads and writes CUDA device memory (asked once). False when it
    cannot be asked: staging is always correct, passing device pointers to a library without
    CUDA support is not."""
    global _CUDA_AWARE
    if _CUDA_AWARE is None:
        _CUDA_AWARE = _query_cuda_support()
    return _CUDA_AWARE


def _query_cuda_support() -> bool:
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query())
        except MPI.Exception:
            return False
    try:
        # mpi4py loads libmpi with RTLD_GLOBAL, so Open MPI's extension is visible here when the
        # library has it; another library (or a copy loaded privately) has no such symbol.
        fn = ctypes.CDLL(None).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return False
    fn.restype, fn.argtypes = ctypes.c_int, []
    return bool(fn())


def _direct(device: torch.device) -> bool:
    """Whether MPI moves tensors on ``device`` itself (host memory, or CUDA-aware MPI)."""
    return device.type == "cpu" or (device.type == "cuda" and cuda_aware())


def _ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and, on a GPU, finished: MPI reads the memory outside torch's streams."""
    t = t.contiguous()
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()
    return t


def _check(payload: torch.Tensor, op: str) -> None:
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 \
            or payload.dim() != 1:
        raise TypeError(f"MpiTransport.{op}: a tensor payload must be a 1-D uint8 tensor, got "
                        f"{type(payload).__name__}")


@mpi_errors("gather")
def gather_tensor(tr, payload: torch.Tensor, root: int, bound: Optional[int] = None
                  ) -> Optional[List[torch.Tensor]]:
    """The gather of ``payload``; the root gets every rank's bytes on ``payload``'s device."""
    _check(payload, "gather_tensor")
    dev = payload.device
    if _direct(dev):
        send = _ready(payload)
        out = tr.gather_buffers(send, root, bound, own=payload.clone,
                                alloc=lambda n: torch.empty(n, dtype=torch.uint8, device=dev))
        return out
    # Pinned host buffers, handed to MPI as numpy views (plain host memory to every mpi4py);
    # the copy in is synchronous, so MPI may read it at once.
    send = to_host(payload).numpy()
    out = tr.gather_buffers(send, root, bound, own=payload.clone,
                            alloc=lambda n: host_buffer(n, pinned=True).numpy())
    if out is None:
        return None
    return [b if r == tr.rank else to_device(torch.from_numpy(b), dev)
            for r, b in enumerate(out)]


@mpi_errors("broadcast")
def broadcast_tensor(tr, payload: Optional[torch.Tensor], root: int, bound: Optional[int],
                     device: torch.device) -> torch.Tensor:
    """The broadcast of the root's ``payload``; every rank gets the bytes on ``device``."""
    dev = torch.device(device)
    is_root = tr.rank == root
    if is_root:
        _check(payload, "broadcast_tensor")
    if _direct(dev):
        send = _ready(payload.to(dev)) if is_root else None
        return tr.broadcast_buffer(send, root, bound,
                                   alloc=lambda n: torch.empty(n, dtype=torch.uint8, device=dev))
    send = to_host(payload).numpy() if is_root else None
    out = tr.broadcast_buffer(send, root, bound,
                              alloc=lambda n: host_buffer(n, pinned=True).numpy())
    return payload.to(dev) if is_root else to_device(torch.from_numpy(out), dev)
