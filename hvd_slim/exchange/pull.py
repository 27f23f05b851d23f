"""The pull side of one rank's step: every server's reply read strictly, and what it delivers
written into each parameter's ``.grad``.

:class:`Puller` is owned by the :class:`~hvd_slim.exchange.worker.Worker`, which commits its
own proposals first; it keeps the buffers each ``p.grad`` of a compressed bucket views.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ..config import SlimConfig
from ..selection import ROLE_PULL, slice_indices
from ..wire import control
from ..wire import message as wm
from .errors import ExchangeError, NonFiniteGradientError
from .expect import shard_pull_expects
from .layout import DENSE, Layout
from .sections import indices_on, section_values
from .shards import Piece, ShardPlan
from .stats import ExchangeStats
from .wirepath import WirePath

# Puller.render's result: per bucket index, the delivered values and whether p.grad may view
# them.
Rendered = Dict[int, Tuple[torch.Tensor, bool]]


# The modes of a pulled section that holds every coordinate of its piece.
WHOLE = (wm.M_DENSE, wm.M_CODED)


class Puller:
    """Reads the replies of a plan's servers and applies the pulled sections."""

    def __init__(self, layout: Layout, config: SlimConfig, shards: ShardPlan, path: WirePath,
                 stats: ExchangeStats, rank: int, size: int, digest: int) -> None:
        self.layout, self.cfg, self.shards, self.path, self.stats = \
            layout, config, shards, path, stats
        self.rank, self.size, self.digest = rank, size, digest
        self._pulled: Dict[int, torch.Tensor] = {}     # sliced pulls; each p.grad views it

    def read(self, bufs: List[Any], t: int, flush: bool) -> Optional[List[List[wm.Section]]]:
        """Every server's reply (one per shard) decoded strictly: the pulled sections per
        shard, or None for a step every rank skips. An ERROR reply from any server raises its
        text (as NonFiniteGradientError for a NaN/Inf under nonfinite="raise"), as does a
        malformed one (ExchangeError); every rank reads the same replies, so all decide alike."""
        roots = self.shards.roots
        whos = ["pull from the server"] if len(roots) == 1 else \
            [f"pull from the server of shard {s} (rank {r})" for s, r in enumerate(roots)]
        try:
            for buf, who in zip(bufs, whos):   # an ERROR anywhere outranks a SKIP
                if self.path.is_error(buf):
                    self.path.peek(buf, who)   # raises its text
            if not flush:
                for buf, who, root in zip(bufs, whos, roots):
                    if self.path.peek(buf, who) == wm.SKIP:
                        self.stats.last_skip = control.decode_text(
                            self.path.host(buf), kind=wm.SKIP, sender=root, step=t,
                            digest=self.digest, who=who)
                        return None
            out = []
            # The world size bounds a union pull: at most ``size * k`` coordinates a bucket.
            expects = shard_pull_expects(self.shards, t, self.cfg.pull, flush, self.size)
            for buf, who, root, expect in zip(bufs, whos, roots, expects):
                out.append(self.path.decode(buf, kind=wm.FLUSH_PULL if flush else wm.PULL,
                                            sender=root, step=t, digest=self.digest,
                                            expect=expect, who=who))
            return out
        except wm.RemoteError as exc:
            if exc.code == wm.E_NONFINITE:
                raise NonFiniteGradientError(str(exc)) from None
            raise ExchangeError(str(exc)) from None
        except wm.WireError as exc:
            raise ExchangeError(f"rank {self.rank}: {exc}") from None

    def write(self, pulled: List[List[wm.Section]], t: int,
              rendered: Optional["Rendered"] = None, scale: float = 1.0) -> None:
        """Write the pulled values (per shard) into ``p.grad``: zeros where nothing was
        delivered, dense sections straight in. ``rendered``: what :meth:`render` already made
        of the same pull; ``scale``: as for :meth:`render`."""
        values = rendered if rendered is not None else self.render(pulled, t, scale)
        for b in self.layout.at_step(t):
            got = values.get(b.index)
            if got is None:
                continue
            flat, view = got
            if view:   # each p.grad becomes a view of the kept buffer (DDP's bucket views)
                self.layout.point_grads(b, flat)
            else:
                self.layout.write_grads(b, flat)

    def render(self, pulled: List[List[wm.Section]], t: int, scale: float = 1.0
               ) -> "Rendered":
        """What the pull delivers, per bucket of step ``t`` (absent: nothing), as one flat
        tensor and whether ``p.grad`` may view it (a host's spread,
        exchange/hosts/hierarchy.py, needs the values before the commit). A compressed
        bucket's values are scattered in place into the buffer this rank keeps for
        it (``_pulled``, zeroed first), which the last committed pull's ``p.grad`` views: call
        it only where that view may be overwritten (at the commit, :meth:`write`; in the
        hierarchy, after the host reduction gave the stand-in pieces a fresh ``.grad``).
        ``scale``: the loss scale of the step's gradients (exchange/loss_scale.py), which a
        compressed bucket's values, in true units, are written back at (1 for a flush)."""
        parts: List[List[Tuple[Piece, wm.Section]]] = [[] for _ in self.layout.buckets]
        for pieces, sections in zip(self.shards.by_shard(t), pulled):
            for p, sec in zip(pieces, sections):
                parts[p.bucket].append((p, sec))
        values: Dict[int, Tuple[torch.Tensor, bool]] = {}
        for b, got in zip(self.layout.at_step(t), parts):
            got.sort(key=lambda ps: ps[0].lo)
            if all(sec.mode == wm.M_EMPTY for _, sec in got):
                continue
            if b.kind == DENSE:   # at the gradients' own scale; cut into pieces: put together
                values[b.index] = (section_values(got[0][1], got[0][0].b), False) \
                    if len(got) == 1 else \
                    (torch.cat([section_values(sec, p.b) for p, sec in got]), False)
                continue
            # A compressed bucket's values are in true units: the loss scale goes back in.
            if len(got) == 1 and got[0][1].mode in WHOLE:
                whole = self._whole(*got[0])
                values[b.index] = (whole if scale == 1.0 else whole.to(b.dtype) * scale, False)
                continue
            # The pull is scattered into a buffer this rank keeps: no copy into separate .grad
            # tensors.
            flat = self._pulled.get(b.index)
            if flat is None:
                flat = self._pulled[b.index] = torch.zeros(b.numel, dtype=b.dtype,
                                                           device=b.device)
            else:
                flat.zero_()
            for p, sec in got:
                part = flat[p.lo:p.hi]
                if sec.mode in WHOLE:
                    part.copy_(self._whole(p, sec))
                    if scale != 1.0:   # in the gradients' dtype: a comm dtype may overflow
                        part.mul_(scale)
                else:
                    idx = self._indices(p, sec, t)
                    try:
                        got_values = section_values(sec, p.b.as_pulled(), idx.numel())
                    except wm.WireError as exc:
                        raise ExchangeError(f"rank {self.rank}: {exc}") from None
                    # index_copy_, not ``part[idx] =``: 1.3-1.5x faster on a CPU; the
                    # coordinates are distinct (the wire's increasing indices, exploration
                    # drawn outside the core)
                    got_values = got_values.to(part.dtype)
                    part.index_copy_(0, idx, got_values if scale == 1.0 else got_values * scale)
            values[b.index] = (flat, True)
        return values

    def _whole(self, p: Piece, sec: wm.Section) -> torch.Tensor:
        """The values of a section of every coordinate of a piece: dense, or coded at
        ``pull_value_bits`` (``M_CODED``)."""
        if sec.mode == wm.M_DENSE:
            return section_values(sec, p.b)
        try:
            return section_values(sec, p.b.as_pulled(), p.b.numel)
        except wm.WireError as exc:
            raise ExchangeError(f"rank {self.rank}: {exc}") from None

    def _indices(self, p: Piece, sec: wm.Section, t: int) -> torch.Tensor:
        """The coordinates of a pulled slice in its piece: explicit, or the server's core plus
        exploration."""
        pb = p.b
        if sec.mode in (wm.M_EXPLICIT, wm.M_SHORT):
            return indices_on(sec.indices, pb)
        return slice_indices(pb.numel, indices_on(sec.indices, pb), pb.k_pull_explore,
                             seed=self.cfg.seed, role=ROLE_PULL,
                             rank=self.shards.roots[p.shard], step=t, bucket=pb.index,
                             device=pb.device, keep=False)   # the last to ask for it
