"""A message's sections read against the bucket they belong to: the values they stand for, their
indices on the bucket's device, and the bytes per value an encoder counts."""
from __future__ import annotations

from typing import Any, List

import torch

from ..wire import message as wm
from ..wire.values import dequantize, unpack
from ..wire.views import from_bytes
from .layout import Bucket


def itemsizes(buckets: List[Bucket], sections: List[wm.Section]) -> List[int]:
    """Bytes per value of each section: the slice dtype's for slices, the comm dtype's else."""
    return [b.slice_bytes if s.mode in wm.SLICED else b.value_bytes
            for b, s in zip(buckets, sections)]


def section_values(sec: wm.Section, b: Bucket, n: int = -1) -> torch.Tensor:
    """What a decoded section's values stand for, in the bucket's dtype on its device: a slice
    in the bucket's slice dtype (value_bits) times ``2**exp``, or its ``n`` values unpacked
    (4- and 2-bit slices), anything else in its comm dtype."""
    if sec.mode in wm.SLICED:
        raw = from_bytes(sec.values, b.slice_dtype).to(b.device)
        if b.slice_bits:
            try:
                return unpack(raw, n, b.slice_bits, b.dtype)
            except ValueError as exc:
                raise wm.WireError(f"bucket {b.index}: {exc}") from None
        return dequantize(raw, sec.exp, b.dtype)
    # No copy when the values are already on the bucket's device in its dtype.
    return from_bytes(sec.values, b.comm_dtype).to(device=b.device, dtype=b.dtype)


def indices_on(idx: Any, b: Bucket) -> torch.Tensor:
    """Decoded int64 indices (numpy, or a tensor in the device path) on the bucket's device."""
    t = idx if isinstance(idx, torch.Tensor) else torch.from_numpy(idx)
    return t.to(b.device)
