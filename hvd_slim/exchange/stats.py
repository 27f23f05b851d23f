"""Counted bytes and times of one rank's exchange, as ``comm_stats()`` reports them."""
from __future__ import annotations

import time
from typing import Dict, List

import numpy as np

from ..wire import message as wm
from .layout import SPARSE, Bucket, Layout


class ExchangeStats:
    """Cumulative figures. ``bytes_pushed``/``bytes_pulled`` are counted by the transport; the
    breakdowns come from the encoded message layout and add up to the same totals (less the
    transport's length words)."""

    # Wall-clock seconds, cumulative, of the five phases that split a step the way docs/design.md
    # §2 orders it, so a benchmark can tell this rank's CPU work (prepare: compensate, select
    # and encode the push; serve: the server's aggregation; apply: decode and apply the pull)
    # from its waits on the wire and on the slowest rank (push: the gather; pull: the
    # broadcast). They cover the exchanges that pass through SlimExchange's phases (not
    # hierarchical's host stages), so they can add up to less than exchange_seconds.
    PHASES = ("prepare", "push", "serve", "pull", "apply")
    FIELDS = ("steps", "skipped_steps", "flushes", "bytes_pushed", "bytes_pulled", "dense_bytes",
              "ring_allreduce_bytes", "push_header_bytes", "push_dense_value_bytes",
              "push_sparse_value_bytes", "push_index_bytes", "pull_header_bytes",
              "pull_value_bytes", "pull_dense_value_bytes", "pull_sparse_value_bytes",
              "pull_index_bytes", "compressed_dense_bytes", "select_seconds", "exchange_seconds",
              "bytes_sent", "bytes_received", "local_bytes_sent", "local_bytes_received"
              ) + tuple(f"{ph}_seconds" for ph in PHASES)
    TIMINGS = ("select_seconds", "exchange_seconds") + tuple(f"{ph}_seconds" for ph in PHASES)

    def __init__(self, layout: Layout, size: int) -> None:
        self._layout = layout
        grad_bytes = sum(b.numel * b.dtype.itemsize for b in layout.buckets)
        self.grad_bytes = grad_bytes
        # The compressed tensors' share of it: what their slices are measured against.
        self.compressed_grad_bytes = sum(b.numel * b.dtype.itemsize for b in layout.sparse)
        # What a bandwidth-optimal ring allreduce sends per rank for the same gradients.
        self.ring_bytes = int(round(2 * (size - 1) / size * grad_bytes)) if size > 1 else 0
        for f in self.FIELDS:
            setattr(self, f, 0)
        for f in self.TIMINGS:
            setattr(self, f, 0.0)
        self.last: Dict[str, int] = {}
        self.last_skip = ""   # why the last skipped step was skipped (every rank has the same)

    def add(self, **parts: int) -> None:
        """Add to the cumulative fields and to this step's figures (``last``)."""
        for name, n in parts.items():
            setattr(self, name, getattr(self, name) + n)
            self.last[name] = self.last.get(name, 0) + n

    def record_push(self, buckets: List[Bucket], sections: List[wm.Section],
                    sizes: Dict[str, int]) -> None:
        """One push message (one per server shard) of ``sections`` for ``buckets``."""
        dense = sum(len(s.values) for b, s in zip(buckets, sections) if b.kind != SPARSE)
        self.add(push_header_bytes=sizes["header"], push_dense_value_bytes=dense,
                  push_sparse_value_bytes=sizes["values"] - dense,
                  push_index_bytes=sizes["indices"])

    def record_pull(self, buckets: List[Bucket], buf: np.ndarray,
                    sections: List[wm.Section]) -> None:
        """One pulled message (one per server shard) of ``sections`` for ``buckets``."""
        values = sum(len(s.values) for s in sections)
        dense = sum(len(s.values) for b, s in zip(buckets, sections) if b.kind != SPARSE)
        index = sum(len(s.idx_bytes) for s in sections)
        self.add(pull_header_bytes=len(buf) - values - index, pull_value_bytes=values,
                  pull_dense_value_bytes=dense, pull_sparse_value_bytes=values - dense,
                  pull_index_bytes=index)

    def timed(self, phase: str, since: float) -> float:
        """Add the seconds from ``since`` (a ``time.perf_counter()``) to ``<phase>_seconds``;
        returns now, the next phase's start."""
        now = time.perf_counter()
        name = f"{phase}_seconds"
        setattr(self, name, getattr(self, name) + (now - since))
        return now

    def finish_step(self, seconds: float) -> None:
        self.steps += 1
        self.dense_bytes += self.grad_bytes
        self.compressed_dense_bytes += self.compressed_grad_bytes
        self.ring_allreduce_bytes += self.ring_bytes
        self.exchange_seconds += seconds

    def as_dict(self) -> Dict[str, float]:
        out = {f: getattr(self, f) for f in self.FIELDS}
        out["last_step"] = dict(self.last)
        out["last_skip_reason"] = self.last_skip
        return out

    def state_dict(self) -> Dict[str, float]:
        return {f: getattr(self, f) for f in self.FIELDS}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        for f, v in state.items():
            if f in self.FIELDS:
                setattr(self, f, v)
