"""Tensor <-> wire bytes, and what each side expects of a message for a given step."""
from __future__ import annotations

from typing import List

import numpy as np
import torch

from ..wire import message as wm
from .layout import DENSE, Bucket, slice_is_smaller


def to_bytes(t: torch.Tensor) -> np.ndarray:
    """Raw bytes of a (CPU) tensor as a uint8 numpy view, no copy when already contiguous."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def from_bytes(buf: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``dtype`` over ``buf`` (which the caller owns and does not reuse)."""
    if len(buf) == 0:
        return torch.empty(0, dtype=dtype)
    return torch.from_numpy(np.ascontiguousarray(buf)).view(dtype)


def is_refresh(step: int, refresh_interval: int) -> bool:
    """Steps on which cores are re-selected and their indices travel."""
    return step % refresh_interval == 0


def pull_is_dense(b: Bucket) -> bool:
    return not slice_is_smaller(b.numel, b.k_pull, b.k_pull_core, b.value_bytes)


def push_expect(buckets: List[Bucket], step: int, q: int, flush: bool = False) -> List[wm.Expect]:
    """What the server accepts from a worker at ``step``."""
    out = []
    for b in buckets:
        if flush:
            modes = {wm.M_EMPTY: (0, 0)} if b.kind == DENSE else {wm.M_DENSE: (b.numel, 0)}
        elif b.kind == DENSE:
            modes = {wm.M_DENSE: (b.numel, 0)}
        elif is_refresh(step, q):
            modes = {wm.M_SLICE: (b.k, b.k_core)}
        else:
            modes = {wm.M_SLICE_CACHED: (b.k, 0)}
        out.append(wm.Expect(b.numel, b.value_bytes, modes))
    return out


def pull_expect(buckets: List[Bucket], step: int, q: int, pull: str,
                flush: bool = False) -> List[wm.Expect]:
    """What a worker accepts from the server at ``step``."""
    out = []
    for b in buckets:
        if flush:
            modes = {wm.M_EMPTY: (0, 0)} if b.kind == DENSE else {wm.M_DENSE: (b.numel, 0)}
        elif b.kind == DENSE:
            modes = {wm.M_DENSE: (b.numel, 0)}
        elif pull == "union":
            modes = {wm.M_EXPLICIT: None, wm.M_DENSE: (b.numel, 0)}
        elif pull_is_dense(b):
            modes = {wm.M_DENSE: (b.numel, 0)}
        elif is_refresh(step, q):
            modes = {wm.M_SLICE: (b.k_pull, b.k_pull_core)}
        else:
            modes = {wm.M_SLICE_CACHED: (b.k_pull, 0)}
        out.append(wm.Expect(b.numel, b.value_bytes, modes))
    return out
