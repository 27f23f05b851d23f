"""What each side expects of a message at a given step, and the most bytes it can take.

A worker's push and the server's pull are decoded against these expectations (modes, counts,
item sizes per bucket), and fixed-size transports pad every message to :func:`message_bound`,
which every rank computes alike from the same expectations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from ..wire import message as wm
from ..wire.indices import index_bytes_bound
from ..wire.values import FP8, packed_nbytes
from .layout import DENSE, Bucket, coded_pull, coded_whole, slice_is_smaller, sent_whole
from .shards import ShardPlan


def pull_is_dense(b: Bucket) -> bool:
    """Whether a ``pull="slim"`` slice of ``b`` would not be smaller than ``b`` sent dense."""
    b = b.as_pulled()
    return not slice_is_smaller(b.numel, b.k_pull, b.k_pull_core, b.slice_bytes, b.value_bytes,
                                b.slice_bits)


Modes = Dict[int, Optional[Tuple[int, int]]]


@dataclass(frozen=True)
class BoundedExpect(wm.Expect):
    """An :class:`~hvd_slim.wire.message.Expect` that also knows the most coordinates an
    explicit section (mode None in ``modes``) can carry here, so :func:`message_bound` need not
    assume d, and decoding refuses a section holding more."""

    most_explicit: Optional[int] = None


def explicit_section_bound(d: int, count: int, itemsize: int) -> int:
    """The most bytes an explicit section of at most ``count`` of ``d`` coordinates takes: the
    values plus their encoded indices. ``index_bytes_bound`` can shrink by one byte when the
    count grows by one (where the Elias-Fano split moves), never by more (checked in
    tests/unit/test_pull_bound.py), so with values of one byte or more the total never shrinks
    as the count grows, and ``count`` itself is the worst case."""
    count = max(0, min(int(count), int(d)))
    return count * itemsize + index_bytes_bound(d, count)


def message_bound(expect: List[wm.Expect]) -> int:
    """The largest message any rank can send under ``expect``: known to every rank, so a
    fixed-size transport pads to it instead of exchanging lengths."""
    total = wm.HEADER.size + wm.ENTRY.size * len(expect)
    for ex in expect:
        worst = 0
        for mode, want in ex.modes.items():
            if want is None:
                continue
            count, n_idx = want
            idx = index_bytes_bound(ex.d, n_idx) if mode in wm.INDEXED else 0
            worst = max(worst, count * ex.itemsize + idx)
        if None in ex.modes.values():
            most = getattr(ex, "most_explicit", None)
            explicit = explicit_section_bound(ex.d, ex.d if most is None else most, ex.itemsize)
            if wm.M_DENSE in ex.modes:
                # Explicit indices (the union pull) are sent only when smaller than dense, the
                # only other choice: the worst case is the smaller of the two, for the most
                # coordinates the section can hold (d when ``most_explicit`` is unknown).
                worst = min(ex.d * ex.itemsize, explicit)
            else:   # a short slice beside the full one (never larger: fewer than its core)
                worst = max(worst, explicit)
        total += worst
    return total


def _slice_modes(k: int, k_core: int, bits: int = 0, short: bool = False) -> Modes:
    """A slice of ``k`` values (packed at ``bits``: its bytes) and its ``k_core`` core
    indices (the explored ones are derived on both sides, never sent); with ``short``, also a
    short slice (wm.M_SHORT) of fewer values than the core, at explicit indices, where the
    values are not packed (a packed code has no zero, so zeros filling a slice are not
    nothing there)."""
    if bits:
        return {wm.M_SLICE: (packed_nbytes(k, bits), k_core)}
    return {wm.M_SLICE: (k, k_core), wm.M_SHORT: None} if short else {wm.M_SLICE: (k, k_core)}


def _expect(buckets: List[Bucket], flush: bool, sparse: Callable[[Bucket], Modes],
            most_explicit: Callable[[Bucket], Optional[int]] = lambda b: None
            ) -> List[wm.Expect]:
    """The shape pushes and pulls share. A flush moves every compressed bucket dense and
    nothing for dense buckets (they have no residual); otherwise dense buckets travel dense and
    ``sparse(b)`` says what a compressed bucket may be."""
    out: List[wm.Expect] = []
    for b in buckets:
        if flush:
            modes: Modes = {wm.M_EMPTY: (0, 0)} if b.kind == DENSE else {wm.M_DENSE: (b.numel, 0)}
        elif b.kind == DENSE:
            modes = {wm.M_DENSE: (b.numel, 0)}
        else:
            modes = sparse(b)
        most = most_explicit(b) if None in modes.values() else None
        sliced = any(m in wm.SLICED for m in modes)
        out.append(BoundedExpect(b.numel, b.slice_bytes if sliced else b.value_bytes, modes,
                                 sliced and b.slice_dtype == FP8, most))
    return out


def push_expect(buckets: List[Bucket], flush: bool = False) -> List[wm.Expect]:
    """What the server accepts from a worker, for a step's ``buckets`` (their sizes at it)."""
    def sparse(b: Bucket) -> Modes:
        if coded_whole(b):
            return {wm.M_CODED: (packed_nbytes(b.numel, b.slice_bits), 0)}
        if sent_whole(b):
            return {wm.M_DENSE: (b.numel, 0)}
        return _slice_modes(b.k, b.k_core, b.slice_bits)

    return _expect(buckets, flush, sparse)


def pull_expect(buckets: List[Bucket], pull: str, flush: bool = False,
                size: Optional[int] = None) -> List[wm.Expect]:
    """What a worker accepts from the server, for a step's ``buckets``. ``size`` (the number of ranks) bounds
    a union pull: its explicit section holds at most the ``size * k`` coordinates the workers
    pushed; without it the bound assumes all d coordinates (dense)."""
    coded = {b.index for b in buckets if coded_pull(b)}   # known before as_pulled() below

    def sparse(b: Bucket) -> Modes:
        if pull == "union":
            return {wm.M_EXPLICIT: None, wm.M_DENSE: (b.numel, 0)}
        if b.index in coded:   # b is as pulled: its slice coding is the pull's
            return {wm.M_CODED: (packed_nbytes(b.numel, b.slice_bits) if b.slice_bits
                                 else b.numel, 0)}
        if pull_is_dense(b):
            return {wm.M_DENSE: (b.numel, 0)}
        return _slice_modes(b.k_pull, b.k_pull_core, b.slice_bits, short=True)

    def most(b: Bucket) -> Optional[int]:
        if pull != "union":   # a short slice holds fewer values than the full one's core
            return max(0, b.k_pull_core - 1)
        return None if size is None else min(b.numel, size * b.k)

    # A pull's slices are coded at pull_value_bits (Bucket.as_pulled).
    return _expect([b.as_pulled() for b in buckets], flush, sparse, most)


def shard_pull_expects(shards: ShardPlan, step: int, pull: str, flush: bool,
                       size: int) -> List[List[wm.Expect]]:
    """:func:`pull_expect` of every shard's pull of ``step``, in shard order: what the reply of
    each shard's server may hold, bounded by the ``size`` ranks (every rank computes the
    same)."""
    return [pull_expect(shards.shard_buckets(step, s), pull, flush, size=size)
            for s in range(shards.servers)]


def pull_bounds(shards: ShardPlan, step: int, pull: str, flush: bool,
                size: int) -> List[int]:
    """The most bytes each shard's pull of ``step`` can take (:func:`shard_pull_expects`)."""
    return [message_bound(expect)
            for expect in shard_pull_expects(shards, step, pull, flush, size)]
