"""Tensor payloads over MPI (:meth:`MpiTransport.gather_tensor` / ``broadcast_tensor``, and
the many-root ``gather_many_tensor`` / ``broadcast_many_tensor``).

mpi4py takes torch tensors directly (through DLPack), host or device memory alike. Device memory
is handed to MPI only when the library says it can read it: Open MPI's
``MPIX_Query_cuda_support()`` (or mpi4py's ``MPI.Query_cuda_support`` where a version has it)
returning 1. Otherwise, and when neither can be asked, each message is staged through pinned host
memory: one device-to-host copy before sending and one host-to-device copy after receiving,
instead of the exchange converting every section to numpy.
"""
from __future__ import annotations

import ctypes
from typing import List, Optional, Sequence

import torch
from mpi4py import MPI

from .base import _check_roots
from .mpi_comm import mpi_errors
from .mpi_many import broadcast_many_buffers, gather_many_buffers
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


def _device_buffer(n: int, dev: torch.device) -> torch.Tensor:
    """A receive buffer MPI writes on ``dev``: the caching allocator may hand back a block that a
    kernel still queued on the stream reads, and MPI writes outside torch's streams."""
    return _ready(torch.empty(n, dtype=torch.uint8, device=dev))


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
                                alloc=lambda n: _device_buffer(n, dev))
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
                                   alloc=lambda n: _device_buffer(n, dev))
    send = to_host(payload).numpy() if is_root else None
    out = tr.broadcast_buffer(send, root, bound,
                              alloc=lambda n: host_buffer(n, pinned=True).numpy())
    return payload.to(dev) if is_root else to_device(torch.from_numpy(out), dev)


@mpi_errors("gather")
def gather_many_tensor(tr, payloads: Sequence[torch.Tensor], roots: Sequence[int],
                       bounds: Sequence[Optional[int]]) -> Optional[List[torch.Tensor]]:
    """The concurrent gather of ``payloads[i]`` to ``roots[i]``; a root gets every rank's bytes
    on the device of the payload it keeps."""
    _check_roots(roots, tr.size, len(payloads), len(bounds))
    for p in payloads:
        _check(p, "gather_many_tensor")
    # Each payload is sent straight or staged by its own device; a root receives as its own
    # payload's device allows.
    sends = [_ready(p) if _direct(p.device) else to_host(p).numpy() for p in payloads]
    mine = payloads[list(roots).index(tr.rank)] if tr.rank in roots else None
    dev = None if mine is None else mine.device
    direct = dev is not None and _direct(dev)
    alloc = (lambda n: _device_buffer(n, dev)) if direct else \
        (lambda n: host_buffer(n, pinned=True).numpy())
    out = gather_many_buffers(tr, sends, roots, bounds, own=lambda: mine.clone(), alloc=alloc)
    if out is None or direct:
        return out
    return [b if r == tr.rank else to_device(torch.from_numpy(b), dev)
            for r, b in enumerate(out)]


@mpi_errors("broadcast")
def broadcast_many_tensor(tr, payload: Optional[torch.Tensor], roots: Sequence[int],
                          bounds: Sequence[Optional[int]], device: torch.device
                          ) -> List[torch.Tensor]:
    """The concurrent broadcasts of the roots' ``payload``; every rank gets the roots' bytes on
    ``device``, in ``roots`` order."""
    _check_roots(roots, tr.size, len(roots), len(bounds))
    dev = torch.device(device)
    is_root = tr.rank in roots
    if is_root:
        _check(payload, "broadcast_many_tensor")
    if _direct(dev):
        send = _ready(payload.to(dev)) if is_root else None
        return broadcast_many_buffers(
            tr, send, roots, bounds,
            alloc=lambda n: _device_buffer(n, dev))
    send = to_host(payload).numpy() if is_root else None
    out = broadcast_many_buffers(tr, send, roots, bounds,
                                 alloc=lambda n: host_buffer(n, pinned=True).numpy())
    return [payload.to(dev) if r == tr.rank else to_device(torch.from_numpy(b), dev)
            for r, b in zip(roots, out)]
