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

import datetime
import time
from typing import Any, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .base import (LENGTH_BYTES, Transport, TransportError, TransportTimeout, _check_roots,
                   as_payload, check_bound)
from .torch_frames import Frames, check_root, check_tensor, deliver, fill

BACKENDS = ("gloo", "nccl")


def _as_tensor(payload: Any) -> torch.Tensor:
    """A checked numpy payload as a CPU uint8 tensor over the same memory."""
    payload = as_payload(payload)
    if not payload.flags.writeable:   # torch.from_numpy warns on read-only memory
        payload = payload.copy()
    return torch.from_numpy(payload)


class TorchDistTransport(Transport):
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
        self.frames = Frames(self.device)
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

    # --- tensor payloads (the exchange's device path) -------------------------------------------
    def device_payloads(self, device: Any) -> bool:
        """NCCL: CUDA tensors, frames on this rank's GPU, nothing through the host. Gloo: CPU
        tensors as they are (no numpy round trip); CUDA tensors through pinned host frames."""
        dev = torch.device(device)
        return dev.type == "cuda" if self.name == "nccl" else True

    def gather_tensor(self, payload: torch.Tensor, root: int, bound: Optional[int] = None
                      ) -> Optional[List[torch.Tensor]]:
        """:meth:`gather` for a 1-D uint8 tensor; the root gets tensors on its device (views of
        the received frames when they live there: no copy)."""
        check_tensor(payload, "gather_tensor")
        check_bound(payload, bound, self.rank, "gather")
        check_root(root, self.size)
        extra = 0
        if bound is None:  # no bound known: agree on the largest payload first
            bound, extra = self._agree_max(len(payload)), LENGTH_BYTES
        step = bound + LENGTH_BYTES
        frame = self.frames.around(payload, bound)
        is_root = self.rank == root
        staged = payload.device.type != "cpu"
        parts = [self.frames.empty(bound, staged) for _ in range(self.size)] if is_root else None
        self._run("gather", dist.gather, frame, gather_list=parts, group_dst=root)
        self.stats.record("gather", step + extra, (self.size * step if is_root else 0) + extra)
        if not is_root:
            return None
        lengths = self.frames.lengths(parts, bound, list(range(self.size)), "gather")
        return [self.frames.payload(p, n, payload.device) for p, n in zip(parts, lengths)]

    def broadcast_tensor(self, payload: Optional[torch.Tensor], root: int,
                         bound: Optional[int] = None, device: Any = "cpu") -> torch.Tensor:
        """:meth:`broadcast` for a 1-D uint8 tensor; every rank gets a tensor on ``device``."""
        check_root(root, self.size)
        dev, is_root = torch.device(device), self.rank == root
        if is_root:
            check_tensor(payload, "broadcast_tensor")
            check_bound(payload, bound, self.rank, "broadcast")
        staged = dev.type != "cpu"
        if bound is None:  # the length word first, then exactly the payload
            n = self._to_device(torch.tensor([len(payload) if is_root else 0], dtype=torch.int64))
            self._run("broadcast", dist.broadcast, n, group_src=root)
            length = int(n.item())
            if is_root:
                buf = payload.to(self.device) if self.device.type != "cpu" else \
                    payload.cpu().contiguous()
            else:
                buf = self.frames.buffer(length, staged)
            if length:
                self._run("broadcast", dist.broadcast, buf, group_src=root)
            moved = length + LENGTH_BYTES
            self.stats.record("broadcast", moved if is_root else 0, moved)
            return payload.to(dev) if is_root else deliver(buf, dev)
        frame = self.frames.around(payload, bound) if is_root else \
            self.frames.empty(bound, staged)
        self._run("broadcast", dist.broadcast, frame, group_src=root)
        moved = bound + LENGTH_BYTES
        self.stats.record("broadcast", moved if is_root else 0, moved)
        if is_root:
            return payload.to(dev)
        n = self.frames.lengths([frame], bound, [root], "broadcast")[0]
        return self.frames.payload(frame, n, dev)

    def gather_many_tensor(self, payloads: Sequence[torch.Tensor], roots: Sequence[int],
                           bounds: Sequence[Optional[int]]) -> Optional[List[torch.Tensor]]:
        """:meth:`gather_many` for 1-D uint8 tensors as one ``all_to_all_single``: each rank
        sends root ``roots[i]`` its frame padded to ``bounds[i]`` (which every rank knows) and
        nothing to the other ranks, so only the roots receive. Counted as the gathers would be
        (the padded frames, and an 8-byte word per root without a bound)."""
        _check_roots(roots, self.size, len(payloads), len(bounds))
        for p, b in zip(payloads, bounds):
            check_tensor(p, "gather_many_tensor")
            check_bound(p, b, self.rank, "gather")
        bounds, extra = list(bounds), [0] * len(roots)
        unbounded = [i for i, b in enumerate(bounds) if b is None]
        if unbounded:  # the largest payload for every root without a bound, in one all-reduce
            t = self._to_device(torch.tensor([len(payloads[i]) for i in unbounded],
                                             dtype=torch.int64))
            self._run("all_reduce", dist.all_reduce, t, op=dist.ReduceOp.MAX)
            for i, n in zip(unbounded, t.tolist()):
                bounds[i], extra[i] = int(n), LENGTH_BYTES
        roots = [int(r) for r in roots]
        me = roots.index(self.rank) if self.rank in roots else None
        step = {r: b + LENGTH_BYTES for r, b in zip(roots, bounds)}
        send_splits = [step.get(d, 0) for d in range(self.size)]
        recv_splits = [step[self.rank] if me is not None else 0] * self.size
        send = self.frames.buffer(sum(send_splits), any(p.device.type != "cpu" for p in payloads))
        # The input is laid out by destination rank, as all_to_all_single splits it.
        by_root = dict(zip(roots, payloads))
        at = 0
        for d, n in enumerate(send_splits):
            if n:
                fill(send[at:at + n], by_root[d])
                at += n
        kept = None if me is None else payloads[me]
        parts = self.frames.buffer(sum(recv_splits),
                                   kept is not None and kept.device.type != "cpu")
        self._run("gather", dist.all_to_all_single, parts, send,
                  output_split_sizes=recv_splits, input_split_sizes=send_splits)
        for i, r in enumerate(roots):
            self.stats.record("gather", step[r] + extra[i],
                              (self.size * step[r] if i == me else 0) + extra[i])
        if me is None:
            return None
        frames = list(parts.split(step[self.rank]))
        lengths = self.frames.lengths(frames, bounds[me], list(range(self.size)), "gather")
        return [self.frames.payload(f, n, kept.device) for f, n in zip(frames, lengths)]

    def broadcast_many_tensor(self, payload: Optional[torch.Tensor], roots: Sequence[int],
                              bounds: Sequence[Optional[int]], device: Any = "cpu"
                              ) -> List[torch.Tensor]:
        """:meth:`broadcast_many` for 1-D uint8 tensors. With every rank a root and every bound
        given, one ``all_gather`` of frames padded to the largest bound (each rank counts its
        frame sent and every frame received, per root as the broadcasts are recorded). Otherwise
        one broadcast per root: an all_gather would move a frame from every non-root too, and
        without bounds the frame size is not known."""
        _check_roots(roots, self.size, len(roots), len(bounds))
        if len(roots) != self.size or any(b is None for b in bounds):
            return super().broadcast_many_tensor(payload, roots, bounds, device)
        roots = [int(r) for r in roots]
        me = roots.index(self.rank)
        check_tensor(payload, "broadcast_many_tensor")
        check_bound(payload, bounds[me], self.rank, "broadcast")
        dev = torch.device(device)
        bound = max(bounds)
        step = bound + LENGTH_BYTES
        got = self.frames.buffer(self.size * step, dev.type != "cpu")
        frames = list(got.split(step))   # rank order, views of one buffer
        self._run("broadcast", dist.all_gather, frames, self.frames.around(payload, bound))
        for r in roots:
            self.stats.record("broadcast", step if r == self.rank else 0, step)
        lengths = self.frames.lengths(frames, bound, list(range(self.size)), "broadcast")
        return [payload.to(dev) if r == self.rank else
                self.frames.payload(frames[r], lengths[r], dev) for r in roots]

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
