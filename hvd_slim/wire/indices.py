"""Codec for a core's index set: sorted, strictly increasing int64 indices within [0, d).

Two encodings; :func:`encode_indices` takes the smaller (ties go to Elias-Fano):

* ``IDX_EF`` (Elias-Fano). With ``n`` indices, ``L = floor(log2(d / n))`` (0 when ``d / n < 2``).
  Section 1: the low ``L`` bits of every index, bit-packed MSB first, ``ceil(n*L / 8)`` bytes.
  Section 2: the high parts ``h_i = idx_i >> L`` as a unary bitvector of ``n + ((d-1) >> L) + 1``
  bits with a one at ``h_i + i``, ``ceil(bits / 8)`` bytes. That is under ``L + 3`` bits per
  index plus two bytes of section padding: about 1.1 bytes per index at density 0.01, and at
  most 2 bytes for densities down to 2**-14 (about 6.1e-5). An empty set takes 0 bytes.
* ``IDX_BITMAP``: bit ``i`` (MSB first) set iff ``i`` is in the set, ``ceil(d / 8)`` bytes.

The byte length is a pure function of ``(kind, d, n)`` (:func:`encoded_size`), so the decoder
checks it exactly. Unused padding bits must be zero. Decoding is strict: any inconsistency
raises :class:`WireError` naming it; it never reads past the buffer.
"""
from __future__ import annotations

from typing import Tuple, Union

import numpy as np

from .errors import WireError

IDX_EF = 1
IDX_BITMAP = 2
KIND_NAMES = {IDX_EF: "elias-fano", IDX_BITMAP: "bitmap"}

BufferLike = Union[np.ndarray, bytes, bytearray, memoryview]


def _low_bits(d: int, n: int) -> int:
    """``floor(log2(d / n))`` in exact integer arithmetic, 0 when ``n == 0`` or ``d / n < 2``."""
    if n <= 0 or d < 2 * n:
        return 0
    return (d // n).bit_length() - 1   # 2**l <= d/n  <=>  2**l <= floor(d/n)


def _ef_sections(d: int, n: int) -> Tuple[int, int, int]:
    """(L, bytes of the low section, bits of the high section) for ``n`` indices in [0, d)."""
    if n == 0:
        return 0, 0, 0
    low = _low_bits(d, n)
    return low, (n * low + 7) // 8, n + ((d - 1) >> low) + 1


def encoded_size(kind: int, d: int, count: int) -> int:
    """Exact byte length of ``count`` indices in [0, d) under encoding ``kind``."""
    d, count = int(d), int(count)
    if d < 0 or not 0 <= count <= d:
        raise WireError(f"index count {count} is not within [0, d={d}]")
    if kind == IDX_EF:
        _, low_bytes, high_bits = _ef_sections(d, count)
        return low_bytes + (high_bits + 7) // 8
    if kind == IDX_BITMAP:
        return (d + 7) // 8
    raise WireError(f"unknown index encoding {kind}, expected one of "
                    f"{sorted(KIND_NAMES)} ({', '.join(KIND_NAMES.values())})")


def index_bytes_bound(d: int, count: int) -> int:
    """The most bytes :func:`encode_indices` produces for ``count`` indices in [0, d)."""
    return min(encoded_size(IDX_EF, d, count), encoded_size(IDX_BITMAP, d, count))


# ------------------------------------------------------------------------------------ encode
def _check_input(idx: np.ndarray, d: int) -> np.ndarray:
    """``idx`` as 1-D int64, or ValueError unless it is sorted, unique and within [0, d)."""
    a = np.asarray(idx)
    if a.ndim != 1:
        raise ValueError(f"indices must be 1-D, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"indices must be integers, got dtype {a.dtype}")
    a = a.astype(np.int64, copy=False)
    if a.size:
        if a[0] < 0 or a[-1] >= d:
            raise ValueError(f"indices must lie in [0, {d}), got first {a[0]} and last {a[-1]}")
        bad = np.flatnonzero(a[1:] <= a[:-1])
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"indices must be strictly increasing: position {i + 1} holds "
                             f"{a[i + 1]} after {a[i]}")
    return a


def _ef_pack(idx: np.ndarray, d: int) -> np.ndarray:
    """Elias-Fano bytes of ``idx`` (assumed valid; no checks, so tests can build bad payloads)."""
    n = idx.size
    low, low_bytes, high_bits = _ef_sections(d, n)
    if n == 0:
        return np.empty(0, dtype=np.uint8)
    parts = []
    if low:
        shifts = np.arange(low - 1, -1, -1, dtype=np.int64)
        bits = ((idx[:, None] >> shifts) & 1).astype(np.uint8)   # n x L, MSB first
        parts.append(np.packbits(bits.ravel()))
    high = np.zeros(high_bits, dtype=np.uint8)
    high[(idx >> low) + np.arange(n, dtype=np.int64)] = 1
    parts.append(np.packbits(high))
    out = np.concatenate(parts) if len(parts) > 1 else parts[0]
    assert out.size == low_bytes + (high_bits + 7) // 8
    return out


def _bitmap_pack(idx: np.ndarray, d: int) -> np.ndarray:
    """Bitmap bytes of ``idx`` (assumed valid)."""
    bits = np.zeros(d, dtype=np.uint8)
    bits[idx] = 1
    return np.packbits(bits)


def encode_as(kind: int, idx: np.ndarray, d: int) -> np.ndarray:
    """Encode ``idx`` (sorted, unique, in [0, d)) with the given ``kind``; uint8 1-D."""
    a = _check_input(idx, int(d))
    if kind == IDX_EF:
        return _ef_pack(a, int(d))
    if kind == IDX_BITMAP:
        return _bitmap_pack(a, int(d))
    raise ValueError(f"unknown index encoding {kind}, expected {IDX_EF} or {IDX_BITMAP}")


def encode_indices(idx: np.ndarray, d: int) -> Tuple[int, np.ndarray]:
    """(kind, uint8 bytes) of the smaller encoding of ``idx``; ties go to Elias-Fano.

    ``idx``: sorted, strictly increasing integers in [0, d); ValueError otherwise.
    """
    d = int(d)
    if d < 0:
        raise ValueError(f"d must be >= 0, got {d}")
    a = _check_input(idx, d)
    if encoded_size(IDX_EF, d, a.size) <= encoded_size(IDX_BITMAP, d, a.size):
        return IDX_EF, _ef_pack(a, d)
    return IDX_BITMAP, _bitmap_pack(a, d)


# ------------------------------------------------------------------------------------ decode
def _as_bytes(buf: BufferLike) -> np.ndarray:
    """``buf`` as a 1-D uint8 array (no copy for arrays and buffers)."""
    if isinstance(buf, np.ndarray):
        if buf.dtype != np.uint8 or buf.ndim != 1:
            raise WireError(f"index payload must be a 1-D uint8 array, got {buf.dtype} {buf.shape}")
        return buf
    if not isinstance(buf, (bytes, bytearray, memoryview)):
        raise WireError(f"index payload must be bytes or a 1-D uint8 array, got "
                        f"{type(buf).__name__}")
    try:
        return np.frombuffer(buf, dtype=np.uint8)
    except (ValueError, TypeError, BufferError) as exc:   # e.g. a non-contiguous memoryview
        raise WireError(f"index payload is not a readable byte buffer: {exc}") from None


def _bits(section: np.ndarray, nbits: int, what: str) -> np.ndarray:
    """The first ``nbits`` bits of ``section``, after checking its padding bits are zero."""
    bits = np.unpackbits(section)
    if bits.size != (nbits + 7) // 8 * 8:   # guarded by the length check; never trust it blindly
        raise WireError(f"{what}: {section.size} bytes, expected {(nbits + 7) // 8}")
    if np.any(bits[nbits:]):
        raise WireError(f"{what}: padding bits after bit {nbits} are set")
    return bits[:nbits]


def decode_indices(kind: int, buf: BufferLike, d: int, count: int) -> np.ndarray:
    """Strictly decode ``count`` indices in [0, d) from ``buf``; sorted int64, or WireError."""
    d, count = int(d), int(count)
    if d < 0:
        raise WireError(f"index space d={d} is negative")
    b = _as_bytes(buf)
    need = encoded_size(kind, d, count)   # raises WireError on unknown kind or bad count
    if b.size != need:
        raise WireError(f"{KIND_NAMES[kind]} payload of {count} indices in d={d}: "
                        f"{b.size} bytes, expected {need}")
    if kind == IDX_BITMAP:
        ones = np.flatnonzero(_bits(b, d, "bitmap"))
        if ones.size != count:
            raise WireError(f"bitmap has {ones.size} set bits, expected {count}")
        return ones.astype(np.int64, copy=False)

    if count == 0:
        return np.empty(0, dtype=np.int64)
    low, low_bytes, high_bits = _ef_sections(d, count)
    ones = np.flatnonzero(_bits(b[low_bytes:], high_bits, "elias-fano high section"))
    if ones.size != count:
        raise WireError(f"elias-fano high section has {ones.size} set bits, expected {count}")
    idx = (ones - np.arange(count, dtype=np.int64)) << low
    if low:
        lbits = _bits(b[:low_bytes], count * low, "elias-fano low section").reshape(count, low)
        weights = np.left_shift(np.int64(1), np.arange(low - 1, -1, -1, dtype=np.int64))
        idx |= lbits.astype(np.int64) @ weights
    bad = np.flatnonzero(idx[1:] <= idx[:-1])
    if bad.size:
        i = int(bad[0])
        raise WireError(f"elias-fano indices not strictly increasing: position {i + 1} "
                        f"holds {idx[i + 1]} after {idx[i]}")
    if idx[-1] >= d:   # increasing, so the last is the largest; all are >= 0 by construction
        raise WireError(f"elias-fano index {idx[-1]} is out of range [0, {d})")
    return idx
