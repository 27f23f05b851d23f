"""The index codec (:mod:`hvd_slim.wire.index_codec`: the format, the checks, the errors) on
numpy arrays: its numpy kernel and the public functions bound to it.

Encoding takes any array-like of integers; decoding takes bytes, a bytearray, a memoryview or a
1-D uint8 array. The format's sizes and names are re-exported here, where callers import them.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np

from . import index_codec as codec
from .errors import WireError
from .index_codec import IDX_BITMAP, IDX_EF, KIND_NAMES, Drop, encoded_size, index_bytes_bound

__all__ = ["IDX_EF", "IDX_BITMAP", "KIND_NAMES", "encoded_size", "index_bytes_bound",
           "encode_as", "encode_indices", "decode_indices", "NumpyKernel"]

BufferLike = Union[np.ndarray, bytes, bytearray, memoryview]


class NumpyKernel:
    """:class:`~hvd_slim.wire.index_codec.IndexKernel` in numpy."""

    index_types = "an array"   # never named: np.asarray takes anything
    payload_types = "bytes or a 1-D uint8 array"

    def as_indices(self, idx: Any) -> Optional[np.ndarray]:
        return np.asarray(idx)

    def as_payload(self, buf: Any) -> Optional[np.ndarray]:
        if isinstance(buf, np.ndarray):
            return buf
        if not isinstance(buf, (bytes, bytearray, memoryview)):
            return None
        try:
            return np.frombuffer(buf, dtype=np.uint8)
        except (ValueError, TypeError, BufferError) as exc:   # e.g. a non-contiguous memoryview
            raise WireError(f"index payload is not a readable byte buffer: {exc}") from None

    def describe(self, a: np.ndarray) -> Tuple[Tuple[int, ...], str, bool]:
        return a.shape, str(a.dtype), bool(np.issubdtype(a.dtype, np.integer))

    def to_int64(self, a: np.ndarray) -> np.ndarray:
        return a.astype(np.int64, copy=False)

    def survey(self, a: np.ndarray) -> Tuple[int, int, Optional[Drop]]:
        bad = a[1:] <= a[:-1]
        drop = None
        if bad.any():   # argmax only then: a valid array costs one compare, no index list
            i = int(np.argmax(bad))
            drop = (i + 1, int(a[i]), int(a[i + 1]))
        return int(a[0]), int(a[-1]), drop

    def arange(self, n: int, like: np.ndarray) -> np.ndarray:
        return counting(n)

    def bits_at(self, pos: np.ndarray, nbits: int) -> np.ndarray:
        bits = np.zeros(nbits, dtype=np.uint8)
        bits[pos] = 1
        return bits

    def table(self, a: np.ndarray, length: int, width: int, bits: int = 63) -> np.ndarray:
        out = np.zeros(length * width, dtype=_int_for(bits))
        out[:a.size] = a
        return out.reshape(length, width)

    def to_bytes(self, a: np.ndarray) -> np.ndarray:
        return a.astype(np.uint8)

    def pack(self, bits: np.ndarray) -> np.ndarray:
        return np.packbits(bits)

    def unpack(self, data: np.ndarray) -> np.ndarray:
        return np.unpackbits(data)

    def any(self, bits: np.ndarray) -> bool:
        return bool(np.any(bits))

    def nonzero(self, bits: np.ndarray) -> np.ndarray:
        # Read as bool (the contract's bits are 0/1): numpy's nonzero has a fast path for bool
        # and not for uint8, 0.4 against 2.4 ms for an Elias-Fano high section of 234k indices
        if bits.dtype == np.uint8:
            bits = bits.view(np.bool_)
        return np.flatnonzero(bits).astype(np.int64, copy=False)

    def cat(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts)


# 0, 1, 2, ... shared by every caller of :func:`counting`, never written after it is made
_COUNTING = np.arange(0, dtype=np.int64)
_COUNTING.flags.writeable = False
# Longer requests get a fresh array: the shared one is kept for good, so it is bounded (32 MiB)
_COUNTING_MAX = 1 << 22


def counting(n: int) -> np.ndarray:
    """``0 .. n-1`` as int64, read-only: a view of one shared array where ``n`` is within
    :data:`_COUNTING_MAX`. A fresh ``np.arange`` of a million entries costs more than the
    arithmetic it feeds (its pages are new each time: 1.7 of the 1.9 ms that the high part of
    an Elias-Fano encoding of 234k indices took), and the codec and exploration ask for one
    per slice. The shared array is only ever replaced by a longer one, never written, so
    threads (the communication thread and the main one) may share it without a lock."""
    global _COUNTING
    if n <= 0:
        return np.empty(0, dtype=np.int64)   # writable: a decoded empty set is handed on
    a = _COUNTING
    if n > a.size:
        if n > _COUNTING_MAX:
            return np.arange(n, dtype=np.int64)
        a = np.arange(min(_COUNTING_MAX, max(n, 2 * a.size)), dtype=np.int64)
        a.flags.writeable = False
        _COUNTING = a
    return a[:n]


def _int_for(bits: int) -> type:
    """The narrowest signed numpy integer holding ``bits`` bits."""
    return np.int16 if bits <= 15 else np.int32 if bits <= 31 else np.int64


NUMPY = NumpyKernel()


def encode_as(kind: int, idx: np.ndarray, d: int) -> np.ndarray:
    """Encode ``idx`` (sorted, unique, in [0, d)) with the given ``kind``; uint8 1-D."""
    return codec.encode_as(NUMPY, kind, idx, d)


def encode_indices(idx: np.ndarray, d: int) -> Tuple[int, np.ndarray]:
    """(kind, uint8 bytes) of the smaller encoding of ``idx``; ties go to Elias-Fano.

    ``idx``: sorted, strictly increasing integers in [0, d); ValueError otherwise.
    """
    return codec.encode_indices(NUMPY, idx, d)


def decode_indices(kind: int, buf: BufferLike, d: int, count: int) -> np.ndarray:
    """Strictly decode ``count`` indices in [0, d) from ``buf``; sorted int64, or WireError."""
    return codec.decode_indices(NUMPY, kind, buf, d, count)


def _ef_pack(idx: np.ndarray, d: int) -> np.ndarray:
    """Elias-Fano bytes of ``idx`` (assumed valid; no checks, so tests can build bad payloads)."""
    return codec.ef_pack(NUMPY, idx, d)
