"""A small memo of what this process computed last, for pure functions whose result a rank
computes twice in one step.

The server is also a worker: it decodes its own push, whose indices it has just encoded, and,
as a worker, decodes its own pull; it regenerates the exploration sets it drew as a sender. Each
of those is a pure function of its input (decoding inverts encoding exactly; exploration depends
only on its key and core), so the result kept from the first computation *is* the second's.
An entry is found by a cheap key and confirmed by comparing its witness (the payload bytes, the
core) element by element, so a hit is never a guess.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Hashable, Optional

import numpy as np
import torch


def _same(a: Any, b: Any) -> bool:
    """Whether two arrays (both numpy or both torch, of one shape) hold equal elements."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.device == b.device and a.dtype == b.dtype and torch.equal(a, b)
    return False


def _copy(a: Any) -> Any:
    return a.copy() if isinstance(a, np.ndarray) else a.clone()


def _nbytes(a: Any) -> int:
    return int(a.nbytes) if isinstance(a, np.ndarray) else a.numel() * a.element_size()


class Recent:
    """The most recent ``(key, witness) -> value`` entries, within ``max_bytes`` of arrays held
    (the oldest go first). Values are copied in and out, so no caller shares a buffer with
    another. Thread-safe: a communication thread may serve while the caller's thread works."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self._items: "OrderedDict[Hashable, tuple]" = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()
        self.hits = 0   # diagnostics for tests and profiles

    def put(self, key: Hashable, witness: Any, value: Any) -> None:
        """Keep ``value`` (a copy) as what ``key`` with ``witness`` gave."""
        size = _nbytes(witness) + _nbytes(value)
        if size > self.max_bytes:
            return
        entry = (_copy(witness), _copy(value), size)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._held -= old[2]
            self._items[key] = entry
            self._held += size
            while self._held > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self._held -= dropped[2]

    def get(self, key: Hashable, witness: Any) -> Optional[Any]:
        """A copy of what ``key`` gave, if its witness equals ``witness``; else None."""
        with self._lock:
            entry = self._items.get(key)
        if entry is None or not _same(entry[0], witness):
            return None
        self.hits += 1
        return _copy(entry[1])
