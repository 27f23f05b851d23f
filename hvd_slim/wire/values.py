"""How a slice's values travel: at full precision, as bfloat16, as 8-bit floats with a scale,
packed 4 or 2 bits a value on a uniform grid with a float32 scale, or packed as signs (1 bit).

``value_bits`` (a Slim-DP keyword) sets the precision of sliced sections: the worker's push and
the server's ``pull="slim"`` slice. Dense sections (small tensors, dense fallback, flush) and
the exact union pull keep the bucket's comm dtype (the parameters' dtype, or float16 under
``Compression.fp16``). Lower precision costs no accuracy in the long run because the sender
keeps what rounding lost in its residual and sends it later (error feedback), so the same bytes
carry more coordinates: 8-bit values with Elias-Fano indices cost about 2 bytes a coordinate at
density 0.01, against about 5 at 32 bits.

8-bit values are ``float8_e4m3fn`` (3 mantissa bits: within 6.25% of the value, over 17
binades) scaled by a power of two chosen per section so that its largest magnitude fits under
448; the exponent travels in the section's table entry, so scaling is exact and adds no bytes.

4- and 2-bit values (SparseLoCo's range) are *packed*: a section's value bytes are a float32
scale ``s`` and then the codes, two or four to a byte, low bits first. 4 bits: the levels
``-7s .. 7s`` (``s = max|x| / 7``, round to nearest); 2 bits: ``±0.5s`` and ``±1.5s``
(``s = max|x| / 1.5``: the top-k coordinates are rarely near zero, so no level is spent on it).
1-bit values are signs: ``+s`` for ``x >= 0``, ``-s`` below, with ``s = mean|x|``, the scale
that leaves the least squared error for a sign code (EF-signSGD's, 1-bit Adam's). Pushed
whole (``density=1.0``: every coordinate, no indices, exchange/layout.py's ``coded_whole``) it
is 32x fewer bytes than float32; what the sign loses stays in the sender's residual.
Such a section's table count is its byte count; the receiver knows how many values it holds
(the slice's coordinates), and every rank decodes the same bytes with the same operations.
"""
from __future__ import annotations

import math
import sys
from typing import Optional, Tuple

import torch

VALUE_BITS = (1, 2, 4, 8, 16, 32)
PACKED_BITS = (1, 2, 4)   # value_bits packed below a byte (pack, unpack)
_LEVELS = {4: 7.0, 2: 1.5}   # the largest level, in units of the scale
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_FP8_NAN = 0x7F  # its NaN bit pattern


def slice_dtype(value_bits: int, comm_dtype: torch.dtype) -> torch.dtype:
    """The dtype of sliced values for ``value_bits``, given the bucket's comm dtype: 8 is scaled
    float8, 16 keeps a 16-bit comm dtype and is bfloat16 otherwise (the range of float32, so it
    cannot overflow), 32 is the comm dtype itself (no change: the values as computed)."""
    if value_bits not in VALUE_BITS:
        raise ValueError(f"value_bits must be one of {VALUE_BITS}, got {value_bits!r}")
    if value_bits in PACKED_BITS and comm_dtype.is_floating_point:
        return torch.uint8   # the packed bytes (Bucket.slice_bits says how many bits a value)
    if value_bits == 8 and comm_dtype.is_floating_point:
        return FP8
    if value_bits == 16 and comm_dtype.is_floating_point and comm_dtype.itemsize > 2:
        return torch.bfloat16
    return comm_dtype


def scale_exponent(x: torch.Tensor) -> int:
    """The power of two ``e`` such that ``x * 2**-e`` fits float8's range: the smallest with
    ``max|x| < 448 * 2**e``, kept where ``x``'s dtype represents ``2**-e`` (0 for zeros or a
    non-finite maximum, which then travels as NaN). One scalar is read on the host."""
    return _exponent_for(_abs_max(x), x.dtype)


def _abs_max(x: torch.Tensor) -> float:
    return float(_abs_max_tensor(x)) if x.numel() else 0.0


def _abs_max_tensor(x: torch.Tensor) -> torch.Tensor:
    """``max|x|`` of a non-empty ``x`` (NaN if it holds one), from its least and greatest
    values: one read and no |x| written (on a CPU, 11.7M values: 2.4 against 21.8 ms)."""
    lo, hi = torch.aminmax(x)
    return torch.maximum(lo.abs(), hi.abs())


def _exponent_for(m: float, dtype: torch.dtype) -> int:
    """:func:`scale_exponent` for a tensor of ``dtype`` whose largest magnitude is ``m``."""
    if m == 0.0 or not math.isfinite(m):
        return 0
    e = math.frexp(m / FP8_MAX)[1]
    info = torch.finfo(dtype)
    # Keep 2**-e and 2**e normal numbers of x's dtype (2**-126 .. 2**127 for float32).
    low, high = math.frexp(info.tiny)[1], math.frexp(info.max)[1] - 1
    return max(low, min(e, high - 1, -low))


def quantize(x: torch.Tensor, dtype: torch.dtype, bits: int = 0
             ) -> Tuple[torch.Tensor, int, Optional[torch.Tensor]]:
    """``(coded, exp, delivered)``: ``x`` in ``dtype`` (or packed at ``bits``, 4 or 2) for the
    wire, its scale exponent, and what the receiver will decode, in ``x``'s dtype (None when
    that is ``x`` exactly)."""
    if bits:
        coded, delivered = pack(x, bits)
        return coded, 0, delivered
    if dtype == x.dtype:
        return x, 0, None
    m = _abs_max(x) if dtype == FP8 else 0.0
    exp = _exponent_for(m, x.dtype) if dtype == FP8 else 0
    coded = (x.mul(2.0 ** -exp) if exp else x).to(dtype)
    if dtype == FP8 and not math.isfinite(m):
        # float8_e4m3fn has no Inf and torch saturates one to +-448: send NaN instead, so a
        # non-finite value (nonfinite="propagate") still arrives non-finite.
        coded.view(torch.uint8)[~torch.isfinite(x)] = _FP8_NAN
    return coded, exp, dequantize(coded, exp, x.dtype)


def dequantize(coded: torch.Tensor, exp: int, dtype: torch.dtype) -> torch.Tensor:
    """The values ``coded`` stands for, in ``dtype``: every rank decodes the same bytes with the
    same two operations, so every rank gets bitwise the same values."""
    if coded.dtype == FP8 and coded.device.type == "cpu":
        # A 256-entry table built by the same conversion: bitwise its result, 4-7x faster
        # than torch's element-wise float8 decoding on a CPU (four of these run every step).
        out = _fp8_from_table(coded.view(torch.uint8), dtype)
    else:
        out = coded.to(dtype)
    return out.mul_(2.0 ** exp) if exp else out


_FP8_TABLES: dict = {}   # target dtype -> the 256 values a float8 byte decodes to
_FP8_PAIRS: dict = {}    # target dtype -> the 65,536 x 2 values a pair of float8 bytes decodes to
# Byte pairs read as one little-endian int16 index: half the indices to convert and gather
# (11.7M values: 34 against 45 ms), where the buffer allows a 2-byte view.
_PAIR_MIN = 1 << 16


def _fp8_from_table(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float8 bytes ``raw`` (uint8, on a CPU) decoded by table lookup: bitwise what torch's
    conversion gives (the tables are made by it)."""
    table = _FP8_TABLES.get(dtype)
    if table is None:
        table = _FP8_TABLES[dtype] = torch.arange(256, dtype=torch.uint8).view(FP8).to(dtype)
    n = raw.numel()
    if n < _PAIR_MIN or n % 2 or raw.storage_offset() % 2 or not raw.is_contiguous() \
            or sys.byteorder != "little":
        return table.index_select(0, raw.to(torch.int32))
    pairs = _FP8_PAIRS.get(dtype)
    if pairs is None:   # row lo + 256 * hi: (value of lo, value of hi)
        pairs = _FP8_PAIRS[dtype] = torch.stack([table.repeat(256),
                                                 table.repeat_interleave(256)], 1).contiguous()
    index = raw.view(torch.int16).to(torch.int32).bitwise_and_(0xFFFF)
    return pairs.index_select(0, index).view(-1)


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes of a packed section of ``n`` values: the float32 scale, then the codes."""
    return 4 + (n * bits + 7) // 8


def pack(x: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(coded, delivered)``: ``x`` packed at ``bits`` (a uint8 tensor of
    :func:`packed_nbytes` bytes on ``x``'s device) and what the receiver will decode from it."""
    if bits == 1:   # a NaN/Inf makes the scale, and so every value decoded, non-finite
        m = x.abs().to(torch.float32).mean() if x.numel() else \
            torch.zeros((), device=x.device)
        coded = _packed((x >= 0).to(torch.uint8), m.reshape(1), bits)
        # What the receiver decodes, decoded the same way: one table gather, 3x faster on a
        # CPU than building it with torch.where from the signs
        return coded, unpack(coded, x.numel(), bits, x.dtype)
    top = _LEVELS[bits]
    m = _abs_max_tensor(x).to(torch.float32) if x.numel() else torch.zeros((), device=x.device)
    scale = (m / top).reshape(1)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    y = x.to(torch.float32) * inv
    if bits == 4:
        codes = torch.round(y).clamp_(-7, 7).add_(8)
    else:
        codes = torch.floor(y + 2.0).clamp_(0, 3)
    coded = _packed(torch.nan_to_num(codes, nan=0.0).to(torch.uint8), scale, bits)
    return coded, unpack(coded, x.numel(), bits, x.dtype)


def _packed(codes: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """The float32 ``scale``, then the ``codes`` packed ``8 // bits`` to a byte, low bits
    first."""
    per = 8 // bits
    pad = (-codes.numel()) % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    groups = codes.view(-1, per)
    packed = groups[:, 0].clone()
    for i in range(1, per):
        packed |= groups[:, i] << (bits * i)
    return torch.cat([scale.view(torch.uint8), packed])


def unpack(coded: torch.Tensor, n: int, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``n`` values a packed section stands for, in ``dtype`` (a ValueError for a section
    of another length)."""
    if coded.numel() != packed_nbytes(n, bits):
        raise ValueError(f"a packed {bits}-bit section of {n} values has "
                         f"{packed_nbytes(n, bits)} bytes, got {coded.numel()}")
    scale = coded[:4].clone().view(torch.float32)
    body = coded[4:]
    if bits == 1:   # each byte's eight values read from a scaled table: one gather
        table = _sign_table(body.device) * scale
        return table.index_select(0, body.to(torch.int32)).reshape(-1)[:n].to(dtype)
    per, mask = 8 // bits, (1 << bits) - 1
    codes = torch.stack([(body >> (bits * i)) & mask for i in range(per)], dim=1).reshape(-1)[:n]
    levels = codes.to(torch.float32)
    levels = levels - 8.0 if bits == 4 else levels - 1.5
    return (levels * scale).to(dtype)


_SIGN_TABLES: dict = {}   # device -> the 256 x 8 signs (+-1.0) a packed byte stands for


def _sign_table(device: torch.device) -> torch.Tensor:
    table = _SIGN_TABLES.get(device)
    if table is None:
        byte = torch.arange(256, dtype=torch.int32).unsqueeze(1)
        bit = (byte >> torch.arange(8, dtype=torch.int32)) & 1
        table = _SIGN_TABLES[device] = (bit.to(torch.float32) * 2.0 - 1.0).to(device)
    return table
