"""The index codec (:mod:`hvd_slim.wire.index_codec`) in torch ops, for indices that live on a
GPU: its torch kernel and the public functions bound to it.

The same front end as the numpy codec (:mod:`hvd_slim.wire.indices`) runs over this kernel, so
the encodings, the choice rule, the bytes and the strict refusals (the same :class:`WireError`
and ValueError texts) are the numpy codec's, and ranks on either path interoperate. Everything
stays on the tensor's device: only a few scalars (counts, validity flags, the first and last
index) are read on the host, and the details of an error message only when there is an error.
"""
from __future__ import annotations

import sys
from typing import Any, Optional, Sequence, Tuple

import torch

from . import index_codec as codec
from .index_codec import Drop

__all__ = ["encode_indices", "encode_as", "decode_indices", "pack_bits", "unpack_bits",
           "TorchKernel"]

# Bit (un)packing by multiplication on 64-bit words: a handful of elementwise int64 ops, the same
# on every device (torch has no packbits; shifting and summing an (n, 8) view is 7x slower on a
# CPU). Words are read little-endian, as x86, ARM and every CUDA device store them.
assert sys.byteorder == "little", "hvd_slim's torch index codec assumes a little-endian host"
# 0x8040201008040201 as a signed int64: byte j of a word (0 or 1) lands on bit 63 - j, so bits
# 56..63 of the product hold bytes 0..7 MSB first; no two terms meet, so nothing carries.
_PACK = 0x8040201008040201 - (1 << 64)
_SPREAD = 0x0101010101010101    # a byte copied into all eight bytes of a word
_PICK = 0x0102040810204080      # byte j keeps bit 7 - j (MSB first)
_ROUND = 0x7F7F7F7F7F7F7F7F     # a non-zero byte reaches its bit 7, none carries out of it


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """``np.packbits`` of a 1-D 0/1 uint8 tensor: MSB first, the last byte zero-padded."""
    n = bits.numel()
    if n == 0:
        return bits.new_empty(0)
    pad = (-n) % 8
    if pad or bits.storage_offset() % 8 or not bits.is_contiguous():
        bits = torch.cat([bits, bits.new_zeros(pad)])   # a fresh, aligned buffer
    words = bits.view(torch.int64)
    return ((words * _PACK) >> 56).bitwise_and_(0xFF).to(torch.uint8)


def unpack_bits(data: torch.Tensor) -> torch.Tensor:
    """``np.unpackbits`` of a 1-D uint8 tensor: 8 bytes of 0/1 per byte, MSB first."""
    words = (data.to(torch.int64) * _SPREAD).bitwise_and_(_PICK)
    return ((words + _ROUND) >> 7).bitwise_and_(_SPREAD).view(torch.uint8)


class TorchKernel:
    """:class:`~hvd_slim.wire.index_codec.IndexKernel` in torch ops, on the tensors' device."""

    index_types = "a tensor"
    payload_types = "a 1-D uint8 tensor"

    def as_indices(self, idx: Any) -> Optional[torch.Tensor]:
        return idx if isinstance(idx, torch.Tensor) else None

    def as_payload(self, buf: Any) -> Optional[torch.Tensor]:
        return buf if isinstance(buf, torch.Tensor) else None

    def describe(self, a: torch.Tensor) -> Tuple[Tuple[int, ...], str, bool]:
        integer = not (a.is_floating_point() or a.is_complex() or a.dtype == torch.bool)
        return tuple(a.shape), str(a.dtype).replace("torch.", ""), integer

    def to_int64(self, a: torch.Tensor) -> torch.Tensor:
        return a.to(torch.int64)

    def survey(self, a: torch.Tensor) -> Tuple[int, int, Optional[Drop]]:
        bad = a[1:] <= a[:-1]
        first, last, n_bad = torch.stack([a[0], a[-1], bad.sum()]).tolist()   # one host read
        drop = None
        if n_bad:
            i = int(bad.nonzero()[0, 0])
            prev, cur = a[i:i + 2].tolist()
            drop = (i + 1, prev, cur)
        return first, last, drop

    def arange(self, n: int, like: torch.Tensor) -> torch.Tensor:
        return torch.arange(n, dtype=torch.int64, device=like.device)

    def bits_at(self, pos: torch.Tensor, nbits: int) -> torch.Tensor:
        bits = torch.zeros(nbits, dtype=torch.uint8, device=pos.device)
        bits[pos] = 1
        return bits

    def table(self, a: torch.Tensor, length: int, width: int, bits: int = 63) -> torch.Tensor:
        dtype = torch.int16 if bits <= 15 else torch.int32 if bits <= 31 else torch.int64
        out = torch.zeros(length * width, dtype=dtype, device=a.device)
        out[:a.numel()] = a
        return out.view(length, width)

    def to_bytes(self, a: torch.Tensor) -> torch.Tensor:
        return a.to(torch.uint8)

    def pack(self, bits: torch.Tensor) -> torch.Tensor:
        return pack_bits(bits)

    def unpack(self, data: torch.Tensor) -> torch.Tensor:
        return unpack_bits(data)

    def any(self, bits: torch.Tensor) -> bool:
        return bool(bits.numel()) and bool(bits.any())   # no host read when there are none

    def nonzero(self, bits: torch.Tensor) -> torch.Tensor:
        return bits.nonzero().reshape(-1)   # reads the number of ones on the host

    def cat(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(parts))


TORCH = TorchKernel()


def encode_as(kind: int, idx: torch.Tensor, d: int) -> torch.Tensor:
    """Encode ``idx`` (sorted, unique, in [0, d)) with the given ``kind``; uint8 1-D tensor."""
    return codec.encode_as(TORCH, kind, idx, d)


def encode_indices(idx: torch.Tensor, d: int) -> Tuple[int, torch.Tensor]:
    """(kind, uint8 bytes on ``idx``'s device) of the smaller encoding; ties go to Elias-Fano.

    ``idx``: a sorted, strictly increasing integer tensor in [0, d); ValueError otherwise.
    """
    return codec.encode_indices(TORCH, idx, d)


def decode_indices(kind: int, buf: torch.Tensor, d: int, count: int) -> torch.Tensor:
    """Strictly decode ``count`` indices in [0, d) from the uint8 tensor ``buf``; sorted int64
    on ``buf``'s device, or WireError (the same as :func:`hvd_slim.wire.indices.decode_indices`)."""
    return codec.decode_indices(TORCH, kind, buf, d, count)
