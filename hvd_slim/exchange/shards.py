"""Sharded servers: how the exchanged coordinates are split among ``servers=S`` server ranks.

Every bucket of at least ``S`` coordinates is cut into ``S`` contiguous pieces of near-equal
length, piece ``s`` going to shard ``s`` (a smaller bucket goes whole to one shard), so each
shard holds about ``1/S`` of every bucket and the servers' loads are balanced by construction
(docs/design.md §2, "Sharded servers"). Shard ``s`` is aggregated by rank ``roots[s]``, spaced evenly over the
ranks so that on a launch with several ranks per host the servers fall on different hosts.

A piece is itself a :class:`~hvd_slim.exchange.layout.Bucket` (its coordinates renumbered from
0), so the server, the wire format and the expectations work on pieces unchanged. Its push and
pull slice sizes are its bucket's, shared out by length (largest remainder: the pieces' sizes
add up to the bucket's exactly, so the budget per step is the same whatever ``S``). Each piece
selects its own core: a shard's share of the budget never depends on where the gradient's mass
lies, so no server can become the busiest NIC by accident, and every message's size is known to
every rank. Exploration is keyed by the piece's id, so explored indices still never travel.

With ``S = 1`` there is one piece per bucket and it *is* the bucket (same index, same sizes):
the exchange is today's, byte for byte.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from .layout import SPARSE, Bucket, Layout, Segment, coded_pull, coded_whole, sent_whole


@dataclass(frozen=True)
class Piece:
    """Coordinates ``[lo, hi)`` of layout bucket ``bucket`` (its position in the step's
    bucket list), aggregated by shard ``shard``; ``b`` is the piece as a bucket of its own."""

    bucket: int
    shard: int
    lo: int
    hi: int
    b: Bucket


def shares(total: int, lengths: Sequence[int]) -> List[int]:
    """``total`` split in proportion to ``lengths`` by largest remainder (ties to the earlier
    piece): integers summing to ``total``, none above its length when ``total <= sum``."""
    d = sum(lengths)
    if d == 0:
        return [0] * len(lengths)
    base = [total * n // d for n in lengths]
    order = sorted(range(len(lengths)), key=lambda i: (-(total * lengths[i] % d), i))
    for i in order[:total - sum(base)]:
        base[i] += 1
    return base


def server_roots(size: int, servers: int, server_rank: int) -> List[int]:
    """The rank aggregating each shard: ``server_rank`` for shard 0, the others evenly spaced
    after it (distinct ranks, since ``servers <= size``)."""
    return [(server_rank + s * size // servers) % size for s in range(servers)]


def piece_id(bucket_index: int, shard: int, servers: int) -> int:
    """A piece's id (keys its server state, selectors and exploration): the bucket's own
    index when there is one shard."""
    return bucket_index * servers + shard


class ShardPlan:
    """The pieces of every bucket, per step (a warm-up changes slice sizes), and the roots."""

    def __init__(self, layout: Layout, servers: int, size: int, server_rank: int) -> None:
        if not 1 <= servers <= size:
            raise ValueError(f"servers must be in 1..{size}, got {servers}")
        self.layout, self.servers = layout, servers
        self.roots = server_roots(size, servers, server_rank)
        # The last sizes cut (a step's key, -1 for the sizes after any warm-up): per bucket its
        # pieces, per shard its pieces and their buckets. Every phase of a step asks for them.
        self._at: Tuple[int, List[List[Piece]], List[List[Piece]], List[List[Bucket]]] = \
            (-2, [], [], [])

    def _plan(self, step: Optional[int]) -> tuple:
        buckets = self.layout.buckets if step is None else self.layout.at_step(step)
        key = -1 if buckets is self.layout.buckets else step
        if self._at[0] != key:
            if self.servers == 1:   # the one piece of a bucket is the bucket itself
                pieces = [[Piece(i, 0, 0, b.numel, b)] for i, b in enumerate(buckets)]
            else:
                pieces = [self._cut(i, b) for i, b in enumerate(buckets)]
            by: List[List[Piece]] = [[] for _ in range(self.servers)]
            for ps in pieces:
                for p in ps:
                    by[p.shard].append(p)
            self._at = (key, pieces, by, [[p.b for p in ps] for ps in by])
        return self._at

    def pieces(self, step: Optional[int]) -> List[List[Piece]]:
        """Per bucket of ``layout.at_step(step)`` (``layout.buckets`` for None: the sizes after
        any warm-up), its pieces in shard order (not to be changed by the caller)."""
        return self._plan(step)[1]

    def shard_buckets(self, step: Optional[int], shard: int) -> List[Bucket]:
        """Shard ``shard``'s pieces as buckets, in bucket order: what its messages carry."""
        return self._plan(step)[3][shard]

    def by_shard(self, step: Optional[int]) -> List[List[Piece]]:
        """Every shard's pieces, in bucket order."""
        return self._plan(step)[2]

    def piece_sizes(self, step: Optional[int]) -> Dict[int, Bucket]:
        """Every piece's bucket by piece id (what checkpoints are checked against)."""
        return {p.b.index: p.b for ps in self.pieces(step) for p in ps}

    def _cut(self, pos: int, b: Bucket) -> List[Piece]:
        S = self.servers
        if b.numel < S:   # too small to cut: whole, to a shard chosen by its index
            s = b.index % S
            return [Piece(pos, s, 0, b.numel, dataclasses.replace(b, index=piece_id(b.index, s, S)))]
        cuts = [s * b.numel // S for s in range(S + 1)]
        lengths = [cuts[s + 1] - cuts[s] for s in range(S)]
        out = []
        sizes = [shares(getattr(b, f), lengths) for f in
                 ("k_core", "k_explore", "k_pull_core", "k_pull_explore")]
        whole = sent_whole(b) if b.kind == SPARSE else None
        for s in range(S):
            kc, ke, kpc, kpe = (sz[s] for sz in sizes)
            if coded_whole(b):   # every piece codes all of its part, as the bucket does
                kc, ke = lengths[s], 0
            if coded_pull(b):
                kpc, kpe = lengths[s], 0
            pb = dataclasses.replace(
                b, index=piece_id(b.index, s, S), segments=_clip(b.segments, cuts[s], cuts[s + 1]),
                numel=lengths[s],
                k=kc + ke, k_core=kc, k_explore=ke, k_pull=kpc + kpe, k_pull_core=kpc,
                k_pull_explore=kpe, whole=whole)
            out.append(Piece(pos, s, cuts[s], cuts[s + 1], pb))
        return out


def _clip(segments: Sequence[Segment], lo: int, hi: int) -> List[Segment]:
    """The parameters' parts inside ``[lo, hi)``, renumbered from ``lo`` (so a NaN/Inf found
    in a piece names its parameter)."""
    out = []
    for g in segments:
        a, z = max(lo, g.offset), min(hi, g.offset + g.numel)
        if a < z:
            out.append(Segment(g.name, g.param, a - lo, z - a))
    return out


class ShardView:
    """Shard ``shard`` of a plan seen as a layout (``at_step``, ``sparse``): what its
    :class:`~hvd_slim.exchange.server.Server` aggregates."""

    def __init__(self, plan: ShardPlan, shard: int) -> None:
        self.plan, self.shard = plan, shard

    def at_step(self, step: Optional[int]) -> List[Bucket]:
        return self.plan.shard_buckets(step, self.shard)

    @property
    def sparse(self) -> List[Bucket]:
        return [b for b in self.plan.shard_buckets(None, self.shard) if b.kind == SPARSE]
