"""How a slice's values travel: at full precision, as bfloat16, or as 8-bit floats with a scale.

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
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

VALUE_BITS = (8, 16, 32)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_FP8_NAN = 0x7F  # its NaN bit pattern


def slice_dtype(value_bits: int, comm_dtype: torch.dtype) -> torch.dtype:
    """The dtype of sliced values for ``value_bits``, given the bucket's comm dtype: 8 is scaled
    float8, 16 keeps a 16-bit comm dtype and is bfloat16 otherwise (the range of float32, so it
    cannot overflow), 32 is the comm dtype itself (no change: the values as computed)."""
    if value_bits not in VALUE_BITS:
        raise ValueError(f"value_bits must be one of {VALUE_BITS}, got {value_bits!r}")
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
    return float(x.abs().max()) if x.numel() else 0.0


def _exponent_for(m: float, dtype: torch.dtype) -> int:
    """:func:`scale_exponent` for a tensor of ``dtype`` whose largest magnitude is ``m``."""
    if m == 0.0 or not math.isfinite(m):
        return 0
    e = math.frexp(m / FP8_MAX)[1]
    info = torch.finfo(dtype)
    # Keep 2**-e and 2**e normal numbers of x's dtype (2**-126 .. 2**127 for float32).
    low, high = math.frexp(info.tiny)[1], math.frexp(info.max)[1] - 1
    return max(low, min(e, high - 1, -low))


def quantize(x: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, int,
                                                               Optional[torch.Tensor]]:
    """``(coded, exp, delivered)``: ``x`` in ``dtype`` for the wire, its scale exponent, and what
    the receiver will decode, in ``x``'s dtype (None when that is ``x`` exactly)."""
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
    out = coded.to(dtype)
    return out.mul_(2.0 ** exp) if exp else out
