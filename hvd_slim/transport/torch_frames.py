"""The frames of :class:`~hvd_slim.transport.torch_dist.TorchDistTransport`'s tensor
collectives: an int64 little-endian length word, the payload, zeros up to the bound (the numpy
collectives' framing, counted alike).

:class:`Frames` builds and reads them on one device. On NCCL that is the rank's GPU, and a
received payload is a view of its frame: only the 8-byte length words are read on the host. On
Gloo it is the host: CPU tensors are framed as they are (no numpy round trip), CUDA tensors
through pinned host frames.
"""
from __future__ import annotations

from typing import Any, List

import numpy as np
import torch

from .base import LENGTH_BYTES, TransportError
from .staging import host_buffer


class Frames:
    """Frames on ``device``: new ones, one around a payload, and their length words read."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def buffer(self, n: int, pinned: bool) -> torch.Tensor:
        """``n`` uninitialised bytes on the frames' device (pinned on the host when asked)."""
        if self.device.type == "cpu":
            return host_buffer(n, pinned)
        return torch.empty(n, dtype=torch.uint8, device=self.device)

    def empty(self, bound: int, pinned: bool) -> torch.Tensor:
        """An unfilled frame for a payload of at most ``bound`` bytes (a receive buffer)."""
        return self.buffer(bound + LENGTH_BYTES, pinned)

    def around(self, payload: torch.Tensor, bound: int) -> torch.Tensor:
        """``payload`` framed to ``bound`` bytes on the frames' device: the length word (written
        there, little-endian as the numpy frame), the payload, zeros."""
        frame = self.empty(bound, pinned=payload.device.type != "cpu")
        fill(frame, payload)
        return frame

    @staticmethod
    def lengths(frames: List[torch.Tensor], bound: int, ranks: List[int], op: str) -> List[int]:
        """The frames' length words, read on the host in one small copy and checked."""
        words = torch.stack([f[:LENGTH_BYTES] for f in frames]).cpu().numpy()
        out = [int(n) for n in words.reshape(-1).view("<i8")]
        for r, n in zip(ranks, out):
            if not 0 <= n <= bound:
                raise TransportError(f"{op}: the frame from rank {r} announces {n} bytes, "
                                     f"outside [0, {bound}]: the ranks disagree on the payload "
                                     "bound")
        return out

    @staticmethod
    def payload(frame: torch.Tensor, n: int, device: Any) -> torch.Tensor:
        """The ``n``-byte payload of ``frame`` on ``device``: a view of the frame (no copy)
        when it already lives there."""
        return deliver(frame[LENGTH_BYTES:LENGTH_BYTES + n], device)


def fill(frame: torch.Tensor, payload: torch.Tensor) -> None:
    """Write ``payload``'s frame into ``frame`` (the whole frame, any bound)."""
    n = len(payload)
    if frame.storage_offset() % LENGTH_BYTES == 0:   # written in place, on the frame's device
        frame[:LENGTH_BYTES].view(torch.int64).fill_(n)
    else:   # a frame inside a larger buffer (all_to_all_single's input) may be unaligned
        frame[:LENGTH_BYTES].copy_(torch.from_numpy(np.array([n], "<i8").view(np.uint8)))
    frame[LENGTH_BYTES:LENGTH_BYTES + n].copy_(payload)
    frame[LENGTH_BYTES + n:].zero_()


def check_tensor(payload: Any, op: str) -> None:
    """A tensor payload is a 1-D uint8 tensor."""
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 \
            or payload.dim() != 1:
        raise TypeError(f"TorchDistTransport.{op}: a tensor payload must be a 1-D uint8 tensor, "
                        f"got {type(payload).__name__}")


def deliver(t: torch.Tensor, device: Any) -> torch.Tensor:
    """``t`` on ``device``: itself (a view, no copy) when it is already there."""
    return t if t.device == torch.device(device) else t.to(device)


def check_root(root: Any, size: int) -> None:
    """``root`` is a rank of a group of ``size``."""
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < size:
        raise ValueError(f"TorchDistTransport: root {root!r} is not a rank in [0, {size})")
