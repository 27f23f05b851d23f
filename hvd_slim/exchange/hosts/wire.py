"""The messages of the host phases of ``hierarchical=True`` (exchange/hosts/hierarchy.py), among the
L ranks of one host. Both end in one byte (a flag, or a verdict), so every piece starts 8-byte
aligned and is read in place.

* **Reduction** (to local rank j): piece j of every bucket of this rank's gradient, read
  straight from the parameters' ``.grad``, then a flag byte: whether this rank's gradient had
  a NaN/Inf anywhere (:data:`BAD`), whether it holds a carry (:data:`CARRIED`, which a flush
  asks).
* **Spread** (from local rank j): its pulled pieces, each an int64 count and then either the
  piece dense (count -1) or its nonzero coordinates (int32 indices, then values): a pulled
  slice is mostly zeros, so the host's memory bus carries about the pull, not the model. Then
  the verdict byte. A verdict other than OK carries a text instead (an error to raise).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..layout import SPARSE, Layout

OK, SKIPPED, FAILED, NONFINITE = 0, 1, 2, 3   # the spread's verdict byte
BAD, CARRIED = 1, 2   # the reduction's flag bits
TEXT_BYTES = 1 << 12   # room for an error's text in the spread


def _pad(n: int) -> int:
    return -(-n // 8) * 8


def cuts(n: int, parts: int) -> List[int]:
    """Bounds of ``parts`` contiguous pieces of ``n`` coordinates, near-equal in length."""
    return [i * n // parts for i in range(parts + 1)]


class HostFrames:
    """Byte layouts of one host's messages: ``layout``'s buckets cut into ``parts`` pieces."""

    def __init__(self, layout: Layout, parts: int) -> None:
        self.layout, self.parts = layout, parts
        self.bounds = {b.index: cuts(b.numel, parts) for b in layout.buckets}
        # Per local rank j: (bucket index, byte offset in the reduction, numel) of its pieces.
        self.places: List[List[Tuple[int, int, int]]] = []
        self.reduce_sizes: List[int] = []
        for j in range(parts):
            at, places = 0, []
            for b in layout.buckets:
                n = self.bounds[b.index][j + 1] - self.bounds[b.index][j]
                if n:   # an empty piece (a bucket smaller than the host) takes no part
                    places.append((b.index, at, n))
                    at += _pad(n * b.dtype.itemsize)
            self.places.append(places)
            self.reduce_sizes.append(at + 1)

    def pieces_of(self, j: int) -> List[int]:
        """The buckets (by index) of which local rank ``j`` has a non-empty piece."""
        return [i for i, _, _ in self.places[j]]

    def spread_bound(self, j: int) -> int:
        """The most bytes local rank ``j``'s spread can take (every rank computes the same)."""
        dense = sum(8 + _pad(n * self.layout.buckets[i].dtype.itemsize)
                    for i, _, n in self.places[j])
        return max(dense, TEXT_BYTES) + 1

    # --- reduction ---------------------------------------------------------------------------
    def encode_reduce(self, j: int, check: bool,
                      carry: Optional[Dict[int, torch.Tensor]] = None, grads: bool = True,
                      scale: float = 1.0) -> Tuple[np.ndarray, bool]:
        """Piece j of every bucket of this rank's gradients (``grads``; else zeros) plus its
        ``carry`` (by bucket, in true units: at the gradients' loss ``scale``), and whether
        they hold a NaN/Inf (``check``); the flag byte is set by :meth:`flag`."""
        buf = np.zeros(self.reduce_sizes[j], np.uint8)
        bad = False
        for i, at, n in self.places[j]:
            b = self.layout.buckets[i]
            lo = self.bounds[i][j]
            out = torch.from_numpy(buf[at:at + n * b.dtype.itemsize]).view(b.dtype)
            for off, numel, g in Layout.grad_parts(b):
                a, z = max(off, lo), min(off + numel, lo + n)
                if a < z and g is not None and grads:
                    out[a - lo:z - lo].copy_(g.reshape(-1)[a - off:z - off])
            if carry and i in carry:
                out.add_(carry[i][lo:lo + n], alpha=scale)
            bad = bad or (check and not bool(torch.isfinite(out).all()))
        return buf, bad

    @staticmethod
    def flag(buf: np.ndarray, bad: bool, carried: bool = False) -> np.ndarray:
        buf[-1] = (BAD if bad else 0) | (CARRIED if carried else 0)
        return buf

    def decode_reduce(self, buf: np.ndarray, j: int) -> Tuple[List[torch.Tensor], int]:
        """The pieces of a reduction message to local rank ``j``, as views, and its flags."""
        if len(buf) != self.reduce_sizes[j]:
            raise ValueError(f"a host reduction has {len(buf)} bytes, expected "
                             f"{self.reduce_sizes[j]}")
        out = []
        for i, at, n in self.places[j]:
            dtype = self.layout.buckets[i].dtype
            out.append(torch.from_numpy(buf[at:at + n * dtype.itemsize]).view(dtype))
        return out, int(buf[-1])

    # --- spread ------------------------------------------------------------------------------
    def encode_spread(self, j: int, pieces: Sequence[torch.Tensor]) -> np.ndarray:
        """Local rank ``j``'s pulled pieces (in :meth:`pieces_of` order), then OK."""
        chunks: List[np.ndarray] = []
        for (i, _, n), x in zip(self.places[j], pieces):
            b = self.layout.buckets[i]
            x = x.detach().reshape(-1).cpu()
            nz = torch.nonzero(x).reshape(-1) if b.kind == SPARSE else None
            if nz is None or _pad(4 * len(nz)) + _pad(len(nz) * b.dtype.itemsize) >= \
                    _pad(n * b.dtype.itemsize):
                chunks += [_count(-1), _padded(x)]
            else:
                chunks += [_count(len(nz)), _padded(nz.to(torch.int32)),
                           _padded(x[nz])]
        chunks.append(np.array([OK], np.uint8))
        return np.concatenate(chunks)

    @staticmethod
    def encode_status(status: int, text: str) -> np.ndarray:
        body = np.frombuffer(text.encode()[:TEXT_BYTES], np.uint8)
        return np.concatenate([body, np.array([status], np.uint8)])

    def decode_spread(self, buf: np.ndarray, j: int) -> Tuple[int, object]:
        """``(OK, {bucket: dense piece})`` or ``(verdict, text)``."""
        status = int(buf[-1])
        if status != OK:
            return status, bytes(buf[:-1]).decode(errors="replace")
        out: Dict[int, torch.Tensor] = {}
        at = 0
        for i, _, n in self.places[j]:
            dtype = self.layout.buckets[i].dtype
            count = int(np.frombuffer(buf[at:at + 8], np.int64)[0])
            at += 8
            if count < 0:
                out[i] = torch.from_numpy(buf[at:at + n * dtype.itemsize]).view(dtype)
                at += _pad(n * dtype.itemsize)
                continue
            idx = torch.from_numpy(buf[at:at + 4 * count]).view(torch.int32).long()
            at += _pad(4 * count)
            val = torch.from_numpy(buf[at:at + count * dtype.itemsize]).view(dtype)
            at += _pad(count * dtype.itemsize)
            piece = torch.zeros(n, dtype=dtype)
            piece[idx] = val
            out[i] = piece
        if at + 1 != len(buf):
            raise ValueError(f"a host spread from local rank {j} has {len(buf)} bytes, "
                             f"expected {at + 1}")
        return OK, out


def _count(n: int) -> np.ndarray:
    return np.array([n], np.int64).view(np.uint8)


def _padded(x: torch.Tensor) -> np.ndarray:
    """The raw bytes of a 1-D CPU tensor, zero-padded to a multiple of 8."""
    raw = x.contiguous().view(torch.uint8).numpy()
    pad = _pad(len(raw)) - len(raw)
    return np.concatenate([raw, np.zeros(pad, np.uint8)]) if pad else raw
