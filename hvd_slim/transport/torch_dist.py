"""torch.distributed transport: the exchange's gather and broadcast over Gloo (CPU) or NCCL (CUDA).

torch's collectives need the same tensor size on every rank, so each payload travels in a
fixed-size *frame*: an int64 little-endian length word, the payload, then zeros up to the bound
the caller announces (every rank computes the same bound, so no sizes are exchanged). Without a
bound the ranks first agree on a frame size: an 8-byte MAX all-reduce for ``gather``, a
broadcast of the length word for ``broadcast``.

Byte accounting follows base.py, counting the padded frames that really move:

* ``gather`` with bound B: every rank sends ``B + 8``; the root receives ``size * (B + 8)``.
  Without a bound, B is the largest payload and each rank also counts the 8-byte all-reduce
  (sent and received).
* ``broadcast`` with bound B: the root sends ``B + 8``, every rank receives ``B + 8``. Without a
  bound: ``len + 8`` (the length word, then the payload), exactly as the MPI transport.
* ``gather_many`` (one ``all_to_all_single``, each rank's frame for a root padded to that
  root's bound) counts as its gathers would: per root, as ``gather`` above.
* ``broadcast_many`` with every rank a root and every bound given (one ``all_gather`` of frames
  padded to the largest bound M): per root, that root sends ``M + 8`` and every rank receives
  ``M + 8``. Otherwise it is one ``broadcast`` per root, counted as those.

Deadlines: inside ``with transport.watch(seconds, label)`` each collective runs asynchronously
and is waited on for at most ``seconds``; otherwise the process group's own timeout applies
(``HVD_SLIM_TRANSPORT_TIMEOUT``). After any failed or timed-out collective the group is in an
unknown state, so the transport refuses further use.

Process groups come from :mod:`hvd_slim.optim.rendezvous`; this module only moves frames.
Two payload forms, counted alike: numpy arrays (``gather``/``broadcast``: the handshake and other
host-built messages; on NCCL such a frame is copied to the device and back), and uint8 tensors
(``gather_tensor``/``broadcast_tensor``, the exchange's device path): on NCCL the frame is built
on the GPU and the received payloads are views of the received frames, so nothing but the 8-byte
length words crosses to the host; on Gloo CPU tensors are framed as they are and CUDA tensors go
through pinned host frames.
"""
from __future__ import annotations

import atexit
import datetime
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from .base import Transport, TransportError, TransportTimeout, as_payload
from .torch_frames import TensorFrames

BACKENDS = ("gloo", "nccl")


def _as_tensor(payload: Any) -> torch.Tensor:
    """A checked numpy payload as a CPU uint8 tensor over the same memory."""
    payload = as_payload(payload)
    if not payload.flags.writeable:   # torch.from_numpy warns on read-only memory
        payload = payload.copy()
    return torch.from_numpy(payload)


class TorchDistTransport(TensorFrames, Transport):
    """Payload collectives over one torch.distributed process group.

    ``device`` is where frames live during a collective: CPU for Gloo, this rank's CUDA device
    for NCCL. ``on_close`` (from the bootstrap) releases the process group."""

    def __init__(self, group: Any, backend: str, device: torch.device, rank: int, size: int,
                 timeout: datetime.timedelta, on_close: Optional[Any] = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        super().__init__(rank, size)
        self.name = backend
        self.group, self.device, self.timeout = group, torch.device(device), timeout
        self._on_close = on_close
        self._closed = False
        self._broken: Optional[str] = None

    # --- helpers -----------------------------------------------------------------------------
    def _run(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Run one collective to completion, within the watch() deadline when one is set; a
        backend failure or timeout becomes a TransportError and retires the transport."""
        if self._closed:
            raise TransportError(f"rank {self.rank}: the {self.name} transport was closed "
                                 f"(hvd_slim.shutdown()); build a new DistributedOptimizer")
        if self._broken is not None:
            raise TransportError(f"rank {self.rank}: the {self.name} transport is unusable after "
                                 f"an earlier failure ({self._broken}); the job must be restarted")
        seconds, label = self.deadline
        if seconds is not None and seconds <= 0:  # torch reads a zero timeout as "none" too
            seconds = None
        start = time.monotonic()
        try:
            if seconds is None:
                fn(*args, group=self.group, **kwargs)
            else:
                work = fn(*args, group=self.group, async_op=True, **kwargs)
                work.wait(timeout=datetime.timedelta(seconds=seconds))
        except RuntimeError as exc:  # DistBackendError and Gloo timeouts are RuntimeErrors
            where = f" in {label}" if label else ""
            first = summary(exc)
            if seconds is not None and time.monotonic() - start >= seconds:
                self._broken = f"{what}{where} timed out after {seconds:g} s"
                raise TransportTimeout(
                    f"rank {self.rank}: {self.name} {what}{where} timed out after {seconds:g} s: "
                    f"a peer never arrived (it died, hangs or is elsewhere)") from exc
            self._broken = f"{what}{where} failed: {first}"
            raise TransportError(
                f"rank {self.rank}: {self.name} {what}{where} failed: {first}; a peer probably died, "
                f"timed out (process-group timeout {self.timeout.total_seconds():.0f} s, "
                f"HVD_SLIM_TRANSPORT_TIMEOUT) or called collectives in a different order") from exc

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device.type == "cpu" else t.to(self.device)

    def _agree_max(self, n: int) -> int:
        t = self._to_device(torch.tensor([n], dtype=torch.int64))
        self._run("all_reduce", dist.all_reduce, t, op=dist.ReduceOp.MAX)
        return int(t.item())

    # --- Transport ---------------------------------------------------------------------------
    def gather(self, payload: np.ndarray, root: int, bound: Optional[int] = None
               ) -> Optional[List[np.ndarray]]:
        # The tensor collective does the framing, checks and counting; numpy is its host view.
        out = self.gather_tensor(_as_tensor(payload), root, bound)
        return None if out is None else [t.numpy() for t in out]

    def broadcast(self, payload: Optional[np.ndarray], root: int, bound: Optional[int] = None
                  ) -> np.ndarray:
        is_root = self.rank == root
        out = self.broadcast_tensor(_as_tensor(payload) if is_root else None, root, bound)
        # The root gets its own payload back: a copy, so the caller's buffer is never aliased.
        return out.numpy().copy() if is_root else out.numpy()

    def gather_many(self, payloads: Sequence[np.ndarray], roots: Sequence[int],
                    bounds: Sequence[Optional[int]]) -> Optional[List[np.ndarray]]:
        # As gather: the tensor collective (one all_to_all_single) does everything.
        out = self.gather_many_tensor([_as_tensor(p) for p in payloads], roots, bounds)
        return None if out is None else [t.numpy() for t in out]

    def broadcast_many(self, payload: Optional[np.ndarray], roots: Sequence[int],
                       bounds: Sequence[Optional[int]]) -> List[np.ndarray]:
        is_root = self.rank in roots
        out = self.broadcast_many_tensor(_as_tensor(payload) if is_root else None, roots, bounds)
        # As broadcast: a root's own payload comes back as a copy, never aliasing the caller's.
        return [t.numpy().copy() if r == self.rank else t.numpy() for r, t in zip(roots, out)]

    def close(self) -> None:
        """Release the process group (once); later collectives raise TransportError."""
        if not self._closed:
            self._closed = True
            if self._on_close is not None:
                self._on_close()


def summary(exc: BaseException, limit: int = 600) -> str:
    """The message of a torch.distributed error without its C++ stack (NCCL's "Last error" line,
    e.g. "Duplicate GPU detected", is kept)."""
    lines = []
    for line in str(exc).splitlines():
        if line.startswith(("Exception raised from", "frame #")):
            break
        if line.strip():
            lines.append(line.strip())
    text = " / ".join(lines) or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def available_backends(cuda: bool) -> List[str]:
    """The torch.distributed backends usable here for parameters on CUDA (``cuda``) or CPU."""
    if not dist.is_available():
        return []
    out = []
    if dist.is_gloo_available():
        out.append("gloo")
    if cuda and dist.is_nccl_available() and torch.cuda.is_available():
        out.append("nccl")
    return out


# --- one transport per (backend, device), shared by every optimizer of the process ----------
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
