"""Tensors as wire bytes and back: the byte views sections are built from and decoded into.

The host path keeps a section's values as a uint8 numpy view of the tensor; the device path
keeps them as a uint8 tensor on the device (:func:`hvd_slim.wire.message_torch.make_section`).
:func:`from_bytes` reads either back as a tensor of the dtype they were sent in.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["to_bytes", "from_bytes"]


def to_bytes(t: torch.Tensor) -> np.ndarray:
    """Raw bytes of a (CPU) tensor as a uint8 numpy view, no copy when already contiguous. The
    host path only: the device path keeps a tensor's bytes as a uint8 view on its device
    (:func:`hvd_slim.wire.message_torch.make_section`)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def from_bytes(buf: Any, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``dtype`` over ``buf`` (numpy bytes, or a uint8 tensor in the device path;
    the caller owns it and does not reuse it), where ``buf`` is (no copy when it can be)."""
    if isinstance(buf, torch.Tensor):
        t = buf
        if t.numel() and (t.storage_offset() % _itemsize(dtype) or not t.is_contiguous()):
            t = t.clone()   # a view at a misaligned offset cannot be reinterpreted in place
        return t.view(dtype)
    if len(buf) == 0:
        return torch.empty(0, dtype=dtype)
    return torch.from_numpy(np.ascontiguousarray(buf)).view(dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
