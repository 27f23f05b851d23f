"""One :class:`~hvd_slim.transport.torch_dist.TorchDistTransport` per (backend, device), shared
by every optimizer of the process, and their teardown at exit or ``hvd_slim.shutdown()``."""
from __future__ import annotations

import atexit
from typing import Dict, Optional, Tuple

import torch

from .torch_dist import TorchDistTransport

_cache: Dict[Tuple[str, str], TorchDistTransport] = {}
_exit_hook = False


def cached(backend: str, device: torch.device) -> Optional[TorchDistTransport]:
    """The open transport for ``(backend, device)``, if one was made."""
    return _cache.get((backend, str(device)))


def remember(transport: TorchDistTransport) -> TorchDistTransport:
    """Cache ``transport``; the first one also schedules :func:`close_all` at exit, so process
    groups are torn down before interpreter teardown and before mpi4py finalises MPI (its exit
    handler was registered earlier, so it runs later)."""
    global _exit_hook
    if not _exit_hook:
        _exit_hook = True
        atexit.register(close_all)
    _cache[(transport.name, str(transport.device))] = transport
    return transport


def close_all() -> None:
    """Close every cached transport; groups made with ``new_group`` go before the default one."""
    import sys
    hosts = sys.modules.get("hvd_slim.runtime.torch_hosts")
    if hosts is not None:   # hierarchical=True's groups first: they live on the world's
        hosts.close_all()
    items = sorted(_cache.values(), key=lambda t: t.group is None)
    _cache.clear()
    for t in items:
        try:
            t.close()
        except Exception:  # noqa: BLE001 - teardown must reach every group even if one fails
            pass
