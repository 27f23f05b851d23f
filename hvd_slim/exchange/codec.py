"""Tensor <-> wire bytes, and what each side expects of a message for a given step."""
from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch

from ..wire import message as wm
from ..wire.indices import index_bytes_bound
from .layout import DENSE, Bucket, slice_is_smaller


def to_bytes(t: torch.Tensor) -> np.ndarray:
    """Raw bytes of a (CPU) tensor as a uint8 numpy view, no copy when already contiguous."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def from_bytes(buf: np.ndarray, dtype: torch.dtype, like: Optional[Bucket] = None) -> torch.Tensor:
    """A tensor of ``dtype`` over ``buf`` (which the caller owns and does not reuse); with
    ``like``, converted to that bucket's dtype and moved to its device."""
    if len(buf) == 0:
        t = torch.empty(0, dtype=dtype)
    else:
        t = torch.from_numpy(np.ascontiguousarray(buf)).view(dtype)
    return t if like is None else t.to(device=like.device, dtype=like.dtype)


def indices_on(idx: np.ndarray, b: Bucket) -> torch.Tensor:
    """Decoded int64 indices as a tensor on the bucket's device."""
    return torch.from_numpy(idx).to(b.device)


def is_refresh(step: int, refresh_interval: int) -> bool:
    """Steps on which cores are re-selected and their indices travel."""
    return step % refresh_interval == 0


def pull_is_dense(b: Bucket) -> bool:
    return not slice_is_smaller(b.numel, b.k_pull, b.k_pull_core, b.value_bytes)


def message_bound(expect: List[wm.Expect]) -> int:
    """The largest message any rank can send under ``expect``: known to every rank, so a
    fixed-size transport pads to it instead of exchanging lengths."""
    total = wm.HEADER.size + wm.ENTRY.size * len(expect)
    for ex in expect:
        worst = 0
        for mode, want in ex.modes.items():
            if want is None:  # explicit indices are sent only when cheaper than dense
                worst = max(worst, ex.d * ex.itemsize)
                continue
            count, n_idx = want
            idx = index_bytes_bound(ex.d, n_idx) if mode in (wm.M_SLICE, wm.M_EXPLICIT) else 0
            worst = max(worst, count * ex.itemsize + idx)
        total += worst
    return total


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
