"""The index codec of :mod:`hvd_slim.wire.indices` in torch ops, for indices that live on a GPU.

Same encodings, same choice rule (the smaller; ties go to Elias-Fano), and bitwise the same
bytes as the numpy codec, so ranks on either path interoperate. Decoding is just as strict and
raises the same :class:`WireError` kinds. Everything stays on the tensor's device: only a few
scalars (counts, validity flags, the first and last index) are read on the host, and the details
of an error message only when there is an error.
"""
from __future__ import annotations

import sys
from typing import Tuple

import torch

from .errors import WireError
from .indices import IDX_BITMAP, IDX_EF, KIND_NAMES, _ef_sections, encoded_size

__all__ = ["encode_indices", "encode_as", "decode_indices", "pack_bits", "unpack_bits"]

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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ------------------------------------------------------------------------------------ encode
def _check_input(idx: torch.Tensor, d: int) -> torch.Tensor:
    """``idx`` as 1-D int64, or ValueError unless it is sorted, unique and within [0, d)
    (one host read of three scalars)."""
    if not isinstance(idx, torch.Tensor):
        raise ValueError(f"indices must be a tensor here, got {type(idx).__name__}")
    if idx.dim() != 1:
        raise ValueError(f"indices must be 1-D, got shape {tuple(idx.shape)}")
    if idx.numel() and (idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool):
        raise ValueError(f"indices must be integers, got dtype {_dtype_name(idx.dtype)}")
    a = idx.to(torch.int64)
    if a.numel():
        bad_order = (a[1:] <= a[:-1])
        first, last, n_bad = torch.stack([a[0], a[-1], bad_order.sum()]).tolist()
        if first < 0 or last >= d:
            raise ValueError(f"indices must lie in [0, {d}), got first {first} and last {last}")
        if n_bad:
            i = int(bad_order.nonzero()[0, 0])
            prev, cur = a[i:i + 2].tolist()
            raise ValueError(f"indices must be strictly increasing: position {i + 1} holds "
                             f"{cur} after {prev}")
    return a


def _ef_pack(idx: torch.Tensor, d: int) -> torch.Tensor:
    """Elias-Fano bytes of ``idx`` (assumed valid), on its device."""
    n, dev = idx.numel(), idx.device
    low, low_bytes, high_bits = _ef_sections(d, n)
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=dev)
    parts = []
    if low:
        # n x L bits, MSB first, a column at a time (an n x L int64 temporary is 3x slower).
        bits = torch.empty(n, low, dtype=torch.uint8, device=dev)
        for j in range(low):
            bits[:, j] = (idx >> (low - 1 - j)) & 1
        parts.append(pack_bits(bits.view(-1)))
    high = torch.zeros(high_bits, dtype=torch.uint8, device=dev)
    high[(idx >> low) + torch.arange(n, dtype=torch.int64, device=dev)] = 1
    parts.append(pack_bits(high))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _bitmap_pack(idx: torch.Tensor, d: int) -> torch.Tensor:
    """Bitmap bytes of ``idx`` (assumed valid), on its device."""
    bits = torch.zeros(d, dtype=torch.uint8, device=idx.device)
    bits[idx] = 1
    return pack_bits(bits)


def encode_as(kind: int, idx: torch.Tensor, d: int) -> torch.Tensor:
    """Encode ``idx`` (sorted, unique, in [0, d)) with the given ``kind``; uint8 1-D tensor."""
    a = _check_input(idx, int(d))
    if kind == IDX_EF:
        return _ef_pack(a, int(d))
    if kind == IDX_BITMAP:
        return _bitmap_pack(a, int(d))
    raise ValueError(f"unknown index encoding {kind}, expected {IDX_EF} or {IDX_BITMAP}")


def encode_indices(idx: torch.Tensor, d: int) -> Tuple[int, torch.Tensor]:
    """(kind, uint8 bytes on ``idx``'s device) of the smaller encoding; ties go to Elias-Fano.

    ``idx``: a sorted, strictly increasing integer tensor in [0, d); ValueError otherwise.
    """
    d = int(d)
    if d < 0:
        raise ValueError(f"d must be >= 0, got {d}")
    a = _check_input(idx, d)
    n = a.numel()
    if encoded_size(IDX_EF, d, n) <= encoded_size(IDX_BITMAP, d, n):
        return IDX_EF, _ef_pack(a, d)
    return IDX_BITMAP, _bitmap_pack(a, d)


# ------------------------------------------------------------------------------------ decode
def _as_bytes(buf: torch.Tensor) -> torch.Tensor:
    if not isinstance(buf, torch.Tensor):
        raise WireError(f"index payload must be a 1-D uint8 tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise WireError(f"index payload must be a 1-D uint8 array, got "
                        f"{_dtype_name(buf.dtype)} {tuple(buf.shape)}")
    return buf


def _ones(section: torch.Tensor, nbits: int, what: str, count: int) -> torch.Tensor:
    """Positions of the set bits among the first ``nbits`` of ``section``, after checking that
    its padding bits are zero and that exactly ``count`` bits are set."""
    bits = unpack_bits(section)
    if bits.numel() != (nbits + 7) // 8 * 8:   # guarded by the length check; never trust it
        raise WireError(f"{what}: {section.numel()} bytes, expected {(nbits + 7) // 8}")
    ones = bits[:nbits].nonzero().reshape(-1)   # the one sync: the number of ones
    pad = bits[nbits:]
    if pad.numel() and bool(pad.any()):
        raise WireError(f"{what}: padding bits after bit {nbits} are set")
    if ones.numel() != count:
        raise WireError(f"{what} has {ones.numel()} set bits, expected {count}")
    return ones


def decode_indices(kind: int, buf: torch.Tensor, d: int, count: int) -> torch.Tensor:
    """Strictly decode ``count`` indices in [0, d) from the uint8 tensor ``buf``; sorted int64
    on ``buf``'s device, or WireError (the same as :func:`hvd_slim.wire.indices.decode_indices`)."""
    d, count = int(d), int(count)
    if d < 0:
        raise WireError(f"index space d={d} is negative")
    b = _as_bytes(buf)
    need = encoded_size(kind, d, count)   # raises WireError on unknown kind or bad count
    if b.numel() != need:
        raise WireError(f"{KIND_NAMES[kind]} payload of {count} indices in d={d}: "
                        f"{b.numel()} bytes, expected {need}")
    if kind == IDX_BITMAP:
        return _ones(b, d, "bitmap", count)
    if count == 0:
        return torch.empty(0, dtype=torch.int64, device=b.device)
    low, low_bytes, high_bits = _ef_sections(d, count)
    ones = _ones(b[low_bytes:], high_bits, "elias-fano high section", count)
    idx = (ones - torch.arange(count, dtype=torch.int64, device=b.device)) << low
    if low:
        lbits = unpack_bits(b[:low_bytes])
        pad = lbits[count * low:]
        if pad.numel() and bool(pad.any()):
            raise WireError(f"elias-fano low section: padding bits after bit {count * low} "
                            "are set")
        cols = lbits[:count * low].view(count, low)
        acc = cols[:, 0].to(torch.int64)
        for j in range(1, low):   # column by column: a weighted row sum is 6x slower on a CPU
            acc = (acc << 1) | cols[:, j]
        idx |= acc
    bad_order = idx[1:] <= idx[:-1]
    n_bad, last = torch.stack([bad_order.sum(), idx[-1]]).tolist()
    if n_bad:
        i = int(bad_order.nonzero()[0, 0])
        prev, cur = idx[i:i + 2].tolist()
        raise WireError(f"elias-fano indices not strictly increasing: position {i + 1} "
                        f"holds {cur} after {prev}")
    if last >= d:   # increasing, so the last is the largest; all are >= 0 by construction
        raise WireError(f"elias-fano index {last} is out of range [0, {d})")
    return idx
