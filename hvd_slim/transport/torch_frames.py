"""The tensor-payload collectives of :class:`~hvd_slim.transport.torch_dist.TorchDistTransport`
(``gather_tensor``/``broadcast_tensor`` and the many-root ``gather_many_tensor`` /
``broadcast_many_tensor``), framed as its numpy collectives are (an int64
little-endian length word, the payload, zeros up to the bound) and counted alike.

On NCCL the frames are built on the rank's GPU and the received payloads are views of the
received frames: only the 8-byte length words are read on the host. On Gloo, CPU tensors are
framed as they are (no numpy round trip) and CUDA tensors go through pinned host frames.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .base import LENGTH_BYTES, TransportError, _check_roots, check_bound
from .staging import host_buffer


class TensorFrames:
    """Mixed into TorchDistTransport, which provides ``device``, ``name``, ``rank``, ``size``,
    ``stats``, ``_run``, ``_agree_max`` and ``_to_device``."""

    def device_payloads(self, device: Any) -> bool:
        """NCCL: CUDA tensors, frames on this rank's GPU, nothing through the host. Gloo: CPU
        tensors as they are (no numpy round trip); CUDA tensors through pinned host frames."""
        dev = torch.device(device)
        return dev.type == "cuda" if self.name == "nccl" else True

    def _buffer(self, n: int, pinned: bool) -> torch.Tensor:
        """``n`` uninitialised bytes on the frames' device (pinned on the host when asked)."""
        if self.device.type == "cpu":
            return host_buffer(n, pinned)
        return torch.empty(n, dtype=torch.uint8, device=self.device)

    def _new_frame(self, bound: int, pinned: bool) -> torch.Tensor:
        return self._buffer(bound + LENGTH_BYTES, pinned)

    def _frame_of(self, payload: torch.Tensor, bound: int) -> torch.Tensor:
        """``payload`` framed to ``bound`` bytes on the frames' device: the length word (written
        there, little-endian as the numpy frame), the payload, zeros."""
        frame = self._new_frame(bound, pinned=payload.device.type != "cpu")
        _fill(frame, payload)
        return frame

    @staticmethod
    def _lengths(frames: List[torch.Tensor], bound: int, ranks: List[int], op: str) -> List[int]:
        """The frames' length words, read on the host in one small copy and checked."""
        words = torch.stack([f[:LENGTH_BYTES] for f in frames]).cpu().numpy()
        out = [int(n) for n in words.reshape(-1).view("<i8")]
        for r, n in zip(ranks, out):
            if not 0 <= n <= bound:
                raise TransportError(f"{op}: the frame from rank {r} announces {n} bytes, "
                                     f"outside [0, {bound}]: the ranks disagree on the payload "
                                     "bound")
        return out

    def gather_tensor(self, payload: torch.Tensor, root: int, bound: Optional[int] = None
                      ) -> Optional[List[torch.Tensor]]:
        """:meth:`gather` for a 1-D uint8 tensor; the root gets tensors on its device (views of
        the received frames when they live there: no copy)."""
        _check_tensor(payload, "gather_tensor")
        check_bound(payload, bound, self.rank, "gather")
        _check_root(root, self.size)
        extra = 0
        if bound is None:  # no bound known: agree on the largest payload first
            bound, extra = self._agree_max(len(payload)), LENGTH_BYTES
        step = bound + LENGTH_BYTES
        frame = self._frame_of(payload, bound)
        is_root = self.rank == root
        staged = payload.device.type != "cpu"
        parts = [self._new_frame(bound, staged) for _ in range(self.size)] if is_root else None
        self._run("gather", dist.gather, frame, gather_list=parts, group_dst=root)
        self.stats.record("gather", step + extra, (self.size * step if is_root else 0) + extra)
        if not is_root:
            return None
        lengths = self._lengths(parts, bound, list(range(self.size)), "gather")
        return [_deliver(p[LENGTH_BYTES:LENGTH_BYTES + n], payload.device)
                for p, n in zip(parts, lengths)]

    def broadcast_tensor(self, payload: Optional[torch.Tensor], root: int,
                         bound: Optional[int] = None, device: Any = "cpu") -> torch.Tensor:
        """:meth:`broadcast` for a 1-D uint8 tensor; every rank gets a tensor on ``device``."""
        _check_root(root, self.size)
        dev, is_root = torch.device(device), self.rank == root
        if is_root:
            _check_tensor(payload, "broadcast_tensor")
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
                buf = host_buffer(length, staged) if self.device.type == "cpu" else \
                    torch.empty(length, dtype=torch.uint8, device=self.device)
            if length:
                self._run("broadcast", dist.broadcast, buf, group_src=root)
            moved = length + LENGTH_BYTES
            self.stats.record("broadcast", moved if is_root else 0, moved)
            return payload.to(dev) if is_root else _deliver(buf, dev)
        frame = self._frame_of(payload, bound) if is_root else self._new_frame(bound, staged)
        self._run("broadcast", dist.broadcast, frame, group_src=root)
        moved = bound + LENGTH_BYTES
        self.stats.record("broadcast", moved if is_root else 0, moved)
        if is_root:
            return payload.to(dev)
        n = self._lengths([frame], bound, [root], "broadcast")[0]
        return _deliver(frame[LENGTH_BYTES:LENGTH_BYTES + n], dev)


    # --- several roots at once (sharded servers) ---------------------------------------------
    def gather_many_tensor(self, payloads: Sequence[torch.Tensor], roots: Sequence[int],
                           bounds: Sequence[Optional[int]]) -> Optional[List[torch.Tensor]]:
        """:meth:`gather_many` for 1-D uint8 tensors as one ``all_to_all_single``: each rank
        sends root ``roots[i]`` its frame padded to ``bounds[i]`` (which every rank knows) and
        nothing to the other ranks, so only the roots receive. Counted as the gathers would be
        (the padded frames, and an 8-byte word per root without a bound)."""
        _check_roots(roots, self.size, len(payloads), len(bounds))
        for p, b in zip(payloads, bounds):
            _check_tensor(p, "gather_many_tensor")
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
        send = self._buffer(sum(send_splits), any(p.device.type != "cpu" for p in payloads))
        # The input is laid out by destination rank, as all_to_all_single splits it.
        by_root = dict(zip(roots, payloads))
        at = 0
        for d, n in enumerate(send_splits):
            if n:
                _fill(send[at:at + n], by_root[d])
                at += n
        kept = None if me is None else payloads[me]
        parts = self._buffer(sum(recv_splits), kept is not None and kept.device.type != "cpu")
        self._run("gather", dist.all_to_all_single, parts, send,
                  output_split_sizes=recv_splits, input_split_sizes=send_splits)
        for i, r in enumerate(roots):
            self.stats.record("gather", step[r] + extra[i],
                              (self.size * step[r] if i == me else 0) + extra[i])
        if me is None:
            return None
        frames = list(parts.split(step[self.rank]))
        lengths = self._lengths(frames, bounds[me], list(range(self.size)), "gather")
        return [_deliver(f[LENGTH_BYTES:LENGTH_BYTES + n], kept.device)
                for f, n in zip(frames, lengths)]

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
        _check_tensor(payload, "broadcast_many_tensor")
        check_bound(payload, bounds[me], self.rank, "broadcast")
        dev = torch.device(device)
        bound = max(bounds)
        step = bound + LENGTH_BYTES
        got = self._buffer(self.size * step, dev.type != "cpu")
        frames = list(got.split(step))   # rank order, views of one buffer
        self._run("broadcast", dist.all_gather, frames, self._frame_of(payload, bound))
        for r in roots:
            self.stats.record("broadcast", step if r == self.rank else 0, step)
        lengths = self._lengths(frames, bound, list(range(self.size)), "broadcast")
        return [payload.to(dev) if r == self.rank else
                _deliver(frames[r][LENGTH_BYTES:LENGTH_BYTES + lengths[r]], dev) for r in roots]


def _fill(frame: torch.Tensor, payload: torch.Tensor) -> None:
    """Write ``payload``'s frame into ``frame`` (the whole frame, any bound)."""
    n = len(payload)
    if frame.storage_offset() % LENGTH_BYTES == 0:   # written in place, on the frame's device
        frame[:LENGTH_BYTES].view(torch.int64).fill_(n)
    else:   # a frame inside a larger buffer (all_to_all_single's input) may be unaligned
        frame[:LENGTH_BYTES].copy_(torch.from_numpy(np.array([n], "<i8").view(np.uint8)))
    frame[LENGTH_BYTES:LENGTH_BYTES + n].copy_(payload)
    frame[LENGTH_BYTES + n:].zero_()


def _check_tensor(payload: Any, op: str) -> None:
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 \
            or payload.dim() != 1:
        raise TypeError(f"TorchDistTransport.{op}: a tensor payload must be a 1-D uint8 tensor, "
                        f"got {type(payload).__name__}")


def _deliver(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: itself (a view, no copy) when it is already there."""
    return t if t.device == torch.device(device) else t.to(device)


def _check_root(root: Any, size: int) -> None:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < size:
        raise ValueError(f"TorchDistTransport: root {root!r} is not a rank in [0, {size})")
