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

This module is the codec's one front end: the input checks, the choice of encoding, the strict
decoding and every error text, over an :class:`IndexKernel` (the few array operations that
differ between numpy and torch). The kernels and the public functions bound to them are
:mod:`hvd_slim.wire.indices` (numpy) and :mod:`hvd_slim.wire.indices_torch` (torch, on any
device); running the same steps over either gives bitwise the same bytes and the same errors.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Protocol, Sequence, Tuple, TypeVar, runtime_checkable

from .errors import WireError
from .recent import Recent

IDX_EF = 1
IDX_BITMAP = 2
KIND_NAMES = {IDX_EF: "elias-fano", IDX_BITMAP: "bitmap"}

# The kernel's array type: np.ndarray or torch.Tensor.
A = TypeVar("A")
# The first entry of an array that is not above the one before it: (its position, the value
# before it, its value).
Drop = Tuple[int, int, int]


@runtime_checkable   # so a test can check both kernels against it
class IndexKernel(Protocol[A]):
    """The array operations the codec runs on: numpy's or torch's. Bit vectors are 1-D uint8
    arrays of 0/1, index arrays 1-D int64; results stay where their input lives (a device
    tensor's on its device), and only what a method returns as a Python value is read back."""

    index_types: str     # what the encoder takes, for its error ("a tensor")
    payload_types: str   # what the decoder takes, for its error ("a 1-D uint8 tensor")

    def as_indices(self, idx: Any) -> Optional[A]:
        """``idx`` as this kernel's array (no copy where possible), None for a type it does not
        take."""

    def as_payload(self, buf: Any) -> Optional[A]:
        """``buf`` as this kernel's array (no copy), None for a type it does not take;
        WireError for a buffer of the right type that cannot be read."""

    def describe(self, a: A) -> Tuple[Tuple[int, ...], str, bool]:
        """(shape, the dtype's name as numpy spells it, whether that dtype is an integer)."""

    def to_int64(self, a: A) -> A:
        """``a`` as int64 (no copy when it is already)."""

    def survey(self, a: A) -> Tuple[int, int, Optional[Drop]]:
        """(first, last, the first :data:`Drop` or None) of a non-empty index array."""

    def arange(self, n: int, like: A) -> A:
        """``0 .. n-1`` as int64, where ``like`` lives (possibly shared: read it, never write
        into it)."""

    def bits_at(self, pos: A, nbits: int) -> A:
        """``nbits`` bits, set at the int64 positions ``pos`` and clear elsewhere."""

    def table(self, a: A, length: int, width: int, bits: int = 63) -> A:
        """``a`` as signed integers of the narrowest width that holds ``bits`` bits (16, 32 or
        64), zero-padded to ``length * width`` entries, as a ``(length, width)`` array (a fresh
        one: the caller writes into it)."""

    def to_bytes(self, a: A) -> A:
        """The integer array ``a`` (each entry in 0..255) as 1-D uint8."""

    def pack(self, bits: A) -> A:
        """Bits into uint8 bytes, MSB first, the last byte zero-padded (``np.packbits``)."""

    def unpack(self, data: A) -> A:
        """uint8 bytes into 8 bits each, MSB first (``np.unpackbits``)."""

    def any(self, bits: A) -> bool:
        """Whether any bit is set (False when there are none)."""

    def nonzero(self, bits: A) -> A:
        """The positions of the set bits, ascending int64."""

    def cat(self, parts: Sequence[A]) -> A:
        """The arrays one after the other."""


# ------------------------------------------------------------------------------------- sizes
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
def check_indices(k: IndexKernel[A], idx: Any, d: int) -> A:
    """``idx`` as 1-D int64, or ValueError unless it is sorted, unique and within [0, d)
    (on a device: one host read of three scalars, more only to describe an error)."""
    a = k.as_indices(idx)
    if a is None:
        raise ValueError(f"indices must be {k.index_types} here, got {type(idx).__name__}")
    shape, dtype, integer = k.describe(a)
    if len(shape) != 1:
        raise ValueError(f"indices must be 1-D, got shape {shape}")
    if shape[0] and not integer:
        raise ValueError(f"indices must be integers, got dtype {dtype}")
    a = k.to_int64(a)
    if shape[0]:
        first, last, drop = k.survey(a)
        if first < 0 or last >= d:
            raise ValueError(f"indices must lie in [0, {d}), got first {first} and last {last}")
        if drop is not None:
            i, prev, cur = drop
            raise ValueError(f"indices must be strictly increasing: position {i} holds "
                             f"{cur} after {prev}")
    return a


def _groups(low: int) -> Tuple[int, int]:
    """(g, B): the fewest values of ``low`` bits, ``g``, that fill whole bytes, ``B`` of them."""
    g = 8 // math.gcd(low, 8)
    return g, g * low // 8


def _pack_low(k: IndexKernel[A], idx: A, low: int) -> A:
    """The low section: the low ``low`` bits of every index, MSB first, index after index.

    Built a byte column at a time over groups of ``g`` values that fill ``B`` whole bytes: each
    byte ORs the (at most ``8 // low + 2``) shifted values that overlap it, so the work is a few
    elementwise ops over ``n / g`` groups per column, with no bit-per-byte temporary (that cost
    8 bytes of traffic per bit, the codec's largest share of a step)."""
    n = len(idx)
    g, nb = _groups(low)
    rows = -(-n // g)
    # Narrow integers where they hold a value shifted by up to 7 bits: the dense warm-up's
    # steps encode millions of indices, and int64 tables were most of that time.
    v = k.table(idx & ((1 << low) - 1), rows, g, low + 7)
    out = k.table(idx[:0], rows, nb, low + 7)
    for b in range(nb):
        acc = None
        for j in range(8 * b // low, min(g, (8 * b + 7) // low + 1)):
            # Value j ends at stream bit (j+1)*low - 1; the byte's last bit is 8b + 7.
            s = 8 * b + 8 - (j + 1) * low
            term = v[:, j] << s if s >= 0 else v[:, j] >> -s
            acc = term if acc is None else acc | term
        out[:, b] = acc & 0xFF
    return k.to_bytes(out.reshape(-1)[:(n * low + 7) // 8])


def _unpack_low(k: IndexKernel[A], section: A, count: int, low: int, what: str) -> A:
    """The inverse of :func:`_pack_low`: ``count`` values (in the narrow integers of its
    tables; they widen when ORed into the int64 indices), after checking that the bits
    after the last one are zero (they decode as further values, which must be 0)."""
    g, nb = _groups(low)
    rows = -(-count // g)
    by = k.table(section, rows, nb, low + 7)
    vals = k.table(section[:0], rows, g, low + 7)
    mask = (1 << low) - 1
    for j in range(g):
        last = (j + 1) * low - 1   # the stream bit of value j's least significant bit
        acc = None
        for b in range(j * low // 8, last // 8 + 1):
            s = last - (8 * b + 7)
            term = by[:, b] << s if s >= 0 else by[:, b] >> -s
            acc = term if acc is None else acc | term
        vals[:, j] = acc & mask
    vals = vals.reshape(-1)
    if k.any(vals[count:]):
        raise WireError(f"{what}: padding bits after bit {count * low} are set")
    return vals[:count]


def ef_pack(k: IndexKernel[A], idx: A, d: int) -> A:
    """Elias-Fano bytes of ``idx`` (assumed valid; no checks, so tests can build bad payloads).
    An empty set needs no special case: both sections are then empty."""
    n = len(idx)
    low, low_bytes, high_bits = _ef_sections(d, n)
    parts = [_pack_low(k, idx, low)] if low else []
    parts.append(k.pack(k.bits_at((idx >> low) + k.arange(n, idx), high_bits)))
    out = k.cat(parts) if len(parts) > 1 else parts[0]
    assert len(out) == low_bytes + (high_bits + 7) // 8
    return out


def bitmap_pack(k: IndexKernel[A], idx: A, d: int) -> A:
    """Bitmap bytes of ``idx`` (assumed valid)."""
    return k.pack(k.bits_at(idx, d))


def encode_as(k: IndexKernel[A], kind: int, idx: Any, d: int) -> A:
    """Encode ``idx`` (sorted, unique, in [0, d)) with the given ``kind``; uint8 1-D."""
    a = check_indices(k, idx, int(d))
    if kind == IDX_EF:
        return ef_pack(k, a, int(d))
    if kind == IDX_BITMAP:
        return bitmap_pack(k, a, int(d))
    raise ValueError(f"unknown index encoding {kind}, expected {IDX_EF} or {IDX_BITMAP}")


def encode_indices(k: IndexKernel[A], idx: Any, d: int) -> Tuple[int, A]:
    """(kind, uint8 bytes) of the smaller encoding of ``idx``; ties go to Elias-Fano.

    ``idx``: sorted, strictly increasing integers in [0, d); ValueError otherwise.
    """
    d = int(d)
    if d < 0:
        raise ValueError(f"d must be >= 0, got {d}")
    a = check_indices(k, idx, d)
    n = len(a)
    kind = IDX_EF if encoded_size(IDX_EF, d, n) <= encoded_size(IDX_BITMAP, d, n) else IDX_BITMAP
    enc = ef_pack(k, a, d) if kind == IDX_EF else bitmap_pack(k, a, d)
    if n >= _RECALL_MIN:
        RECENT.put((type(k), kind, d, n, len(enc)), enc, a)
    return kind, enc


# The last encodings this process made: a server decoding its own push, or a worker its own
# server's pull, gets the indices back without decoding (wire/recent.py).
# Only sets worth it are kept: under a few thousand indices decoding costs microseconds.
RECENT = Recent(max_bytes=64 << 20)
_RECALL_MIN = 4096


# ------------------------------------------------------------------------------------ decode
def _payload(k: IndexKernel[A], buf: Any) -> A:
    """``buf`` as a 1-D uint8 array of the kernel's type, or WireError."""
    b = k.as_payload(buf)
    if b is None:
        raise WireError(f"index payload must be {k.payload_types}, got {type(buf).__name__}")
    shape, dtype, _ = k.describe(b)
    if dtype != "uint8" or len(shape) != 1:
        raise WireError(f"index payload must be a 1-D uint8 array, got {dtype} {shape}")
    return b


def _bits(k: IndexKernel[A], section: A, nbits: int, what: str) -> A:
    """The first ``nbits`` bits of ``section``, after checking its padding bits are zero."""
    bits = k.unpack(section)
    if len(bits) != (nbits + 7) // 8 * 8:   # guarded by the length check; never trust it blindly
        raise WireError(f"{what}: {len(section)} bytes, expected {(nbits + 7) // 8}")
    if k.any(bits[nbits:]):
        raise WireError(f"{what}: padding bits after bit {nbits} are set")
    return bits[:nbits]


def _ones(k: IndexKernel[A], section: A, nbits: int, what: str, count: int) -> A:
    """The positions of the set bits among the first ``nbits`` of ``section``, after checking
    its padding and that exactly ``count`` bits are set."""
    ones = k.nonzero(_bits(k, section, nbits, what))
    if len(ones) != count:
        raise WireError(f"{what} has {len(ones)} set bits, expected {count}")
    return ones


def decode_indices(k: IndexKernel[A], kind: int, buf: Any, d: int, count: int) -> A:
    """Strictly decode ``count`` indices in [0, d) from ``buf``; sorted int64, or WireError."""
    d, count = int(d), int(count)
    if d < 0:
        raise WireError(f"index space d={d} is negative")
    b = _payload(k, buf)
    need = encoded_size(kind, d, count)   # raises WireError on unknown kind or bad count
    if len(b) != need:
        raise WireError(f"{KIND_NAMES[kind]} payload of {count} indices in d={d}: "
                        f"{len(b)} bytes, expected {need}")
    if count >= _RECALL_MIN:
        known = RECENT.get((type(k), kind, d, count, len(b)), b)
        if known is not None:
            return known
    if kind == IDX_BITMAP:
        return _ones(k, b, d, "bitmap", count)
    if count == 0:
        return k.arange(0, b)   # no indices, where the payload lives
    low, low_bytes, high_bits = _ef_sections(d, count)
    ones = _ones(k, b[low_bytes:], high_bits, "elias-fano high section", count)
    idx = (ones - k.arange(count, b)) << low
    if low:
        idx |= _unpack_low(k, b[:low_bytes], count, low, "elias-fano low section")
    _, last, drop = k.survey(idx)
    if drop is not None:
        i, prev, cur = drop
        raise WireError(f"elias-fano indices not strictly increasing: position {i} "
                        f"holds {cur} after {prev}")
    if last >= d:   # increasing, so the last is the largest; all are >= 0 by construction
        raise WireError(f"elias-fano index {last} is out of range [0, {d})")
    return idx
