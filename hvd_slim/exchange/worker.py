"""The worker's side of a step, for one rank: compensate and select (speculatively), read the
server's pull and apply it, and settle the outcome on this rank's memory.

A :class:`Worker` is handed everything it reads when it is built (layout, settings, rank, world
size, digest, the :class:`~hvd_slim.exchange.wirepath.WirePath` its sections take and the
stats it adds to) and owns this rank's residuals and selectors.
:class:`~hvd_slim.exchange.step.SlimExchange` calls it phase by phase.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..config import SlimConfig
from ..memory import ResidualMemory
from ..selection import ROLE_PUSH, CoreSelector, significance, slice_indices
from ..wire import message as wm
from ..wire.values import quantize
from .finite import nonfinite_params, nonfinite_sent, nonfinite_text
from .layout import DENSE, Bucket, Layout, coded_whole, sent_whole
from .pull import Puller
from .shards import Piece, ShardPlan
from .stats import ExchangeStats
from .wirepath import WirePath


# The values a lossy coding delivers, and the dtype coded to (for an overflow report).
Lossy = Tuple[torch.Tensor, torch.dtype]


def _lossy(delivered: Optional[torch.Tensor], coded: torch.Tensor) -> Optional[Lossy]:
    return None if delivered is None else (delivered, coded.dtype)


@dataclass
class Proposal:
    """One bucket's part of the step in flight, applied to the memory only on success."""

    index: int
    sel: Optional[torch.Tensor]            # coordinates sent (None: all of them)
    delivered: Optional[torch.Tensor]      # what the receiver sees there, when lossy
    mask_velocity: float = 1.0             # share of the velocity dropped at ``sel``
    a: Optional[torch.Tensor] = None       # proposed residual before forgetting ``sel``
    u_new: Optional[torch.Tensor] = None   # proposed velocity (momentum correction)
    left: Optional[torch.Tensor] = None    # what stays at ``sel``: a there, less ``delivered``


@dataclass
class Compensated:
    """What the compensate phase hands to select: each bucket's proposed ``(a, u_new)`` (a dense
    bucket's flat gradient and None), or, when a value is NaN/Inf, nothing and a report naming
    the tensors."""

    proposed: List[Tuple[torch.Tensor, Optional[torch.Tensor]]]
    report: Optional[str] = None


class Worker:
    """One rank's worker state (residuals and selectors) and its phases of a step.

    Residuals and velocities are kept per bucket; selection works per piece of a bucket (one
    piece per server shard, shards.py), so selectors are kept by piece id (the bucket's index
    when there is one server). Messages are lists of sections per shard."""

    def __init__(self, layout: Layout, config: SlimConfig, rank: int, size: int, digest: int,
                 path: WirePath, stats: ExchangeStats,
                 momentum: Optional[Dict[int, dict]] = None,
                 shards: Optional[ShardPlan] = None) -> None:
        self.layout, self.cfg, self.path, self.stats = layout, config, path, stats
        self.rank, self.size, self.digest = rank, size, digest
        self.shards = ShardPlan(layout, 1, size, config.server_rank) if shards is None else shards
        momentum = momentum or {}
        self.memory = {b.index: ResidualMemory(b.numel, b.state_dtype, b.device,
                                               decay=config.residual_decay,
                                               **momentum.get(b.index, {}))
                       for b in layout.sparse}
        self.selector = {p.b.index: CoreSelector() for ps in self.shards.pieces(None)
                         for p in ps if p.b.kind != DENSE}
        self.puller = Puller(layout, config, self.shards, path, stats, rank, size, digest)
        # A compressed bucket's proposal becomes its residual at commit: the state dtype.
        self._flat = {b.index: torch.zeros(b.numel, dtype=b.dtype if b.kind == DENSE
                                           else b.state_dtype, device=b.device)
                      for b in layout.buckets}
        self._score: Dict[int, torch.Tensor] = {}   # only with magnitude_weight > 0
        self._pending: List[Proposal] = []
        # The loss scale of this step's gradients (exchange/loss_scale.py), read at compensate:
        # taken out of what is compressed, put back into what is pulled (1 for a flush).
        self.scale = 1.0

    # --- compensate and select ---------------------------------------------------------------
    def compensate(self, t: int) -> Compensated:
        """Every bucket's proposed ``a = r + u`` read straight from the ``.grad``s (speculative:
        no memory changes), or (a NaN/Inf, unless nonfinite is "propagate") a report instead."""
        self._pending = []
        self.scale = self.layout.loss_scale.read()
        check = self.cfg.nonfinite != "propagate"
        folded, bad = [], []
        for b in self.layout.at_step(t):
            x, u_new = self._fold(b)
            # Compressed buckets are checked after folding: residual and velocity are always
            # finite, so a NaN/Inf in ``a`` is one in this step's gradient.
            if check:
                bad += nonfinite_params(b, x)
            folded.append((x, u_new))
        if bad:
            return Compensated([], nonfinite_text(bad, overflow=False))
        return Compensated(folded)

    def select(self, t: int, compensated: Compensated
               ) -> Tuple[List[List[wm.Section]], Optional[str]]:
        """Every shard's push sections (its pieces', in bucket order), or (NaN/Inf found by
        compensate, or made by a lossy coding, and nonfinite is not "propagate") no sections and
        a report naming the tensors."""
        if compensated.report is not None:
            return [], compensated.report
        check = self.cfg.nonfinite != "propagate"
        out: List[List[wm.Section]] = [[] for _ in range(self.shards.servers)]
        overflow: List[str] = []
        sent_dtype = None
        for b, pieces, (x, u_new) in zip(self.layout.at_step(t), self.shards.pieces(t),
                                         compensated.proposed):
            secs, lossy, sel = self._select(b, pieces, t, x, u_new)
            if check and lossy is not None:   # what a lossy coding made of the values
                found = nonfinite_sent(b, lossy[0], sel)
                overflow, sent_dtype = overflow + found, (lossy[1] if found else sent_dtype)
            for p, sec in zip(pieces, secs):
                out[p.shard].append(sec)
        if overflow:
            return [], nonfinite_text(overflow, overflow=True, sent_dtype=sent_dtype)
        return out, None

    def flush_sections(self) -> List[List[wm.Section]]:
        """Every residual as dense sections, per shard (dense buckets send nothing), pending
        until the flush's pull says it went through."""
        self._pending = []
        self.scale = 1.0   # residuals are in true units, and so is the step flush runs
        out: List[List[wm.Section]] = [[] for _ in range(self.shards.servers)]
        for b, pieces in zip(self.layout.buckets, self.shards.pieces(None)):
            if b.kind == DENSE:
                for p in pieces:
                    out[p.shard].append(self.path.empty())
                continue
            values = self.memory[b.index].residual.to(b.comm_dtype, copy=True)
            delivered = values.to(b.dtype) if b.comm_dtype != b.dtype else None
            # Nothing is masked: the velocity stays (a flush sends residuals, not momentum).
            self._pending.append(Proposal(index=b.index, sel=None, delivered=delivered,
                                          mask_velocity=0.0))
            for p, part in zip(pieces, _cut(values, pieces)):
                out[p.shard].append(self.path.section(wm.M_DENSE, part, p.b.numel))
        return out

    def _fold(self, b: Bucket) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """A dense bucket's flat gradient, or a compressed bucket's proposed ``(a, u_new)``
        computed straight from each parameter's ``.grad`` (speculative: nothing changes yet)."""
        flat, f = self._flat[b.index], self.cfg.gradient_predivide_factor
        # A compressed bucket takes its gradient in true units: its residual outlives the step's
        # loss scale. (S * g) / (f * S) is bitwise g / f, S being a power of two.
        div = (f if self.cfg.op == "average" else 1.0) * (1.0 if b.kind == DENSE else self.scale)
        if b.kind == DENSE or div != 1.0:
            g = self.layout.read_grads(b, flat)
            if div != 1.0:
                g.div_(div)
            return (g, None) if b.kind == DENSE else self.memory[b.index].propose(g)
        return self.memory[b.index].propose_parts(self.layout.grad_parts(b), flat)

    def _select(self, b: Bucket, pieces: List[Piece], t: int, a: torch.Tensor,
                u_new: Optional[torch.Tensor]
                ) -> Tuple[List[wm.Section], Optional[Lossy], Optional[torch.Tensor]]:
        """This bucket's sections, one per piece; the values a lossy coding delivers (and its
        dtype), for the overflow check; and the bucket's coordinates sent (None: all)."""
        cfg = self.cfg
        if b.kind == DENSE or sent_whole(b):
            coded, _, delivered = quantize(a, b.comm_dtype)
            if b.kind != DENSE:
                # A dense warm-up step: all of a goes, and the velocity is not masked (masking
                # every coordinate every step would cancel the momentum): dense momentum SGD.
                self._pending.append(Proposal(index=b.index, sel=None, delivered=delivered,
                                              mask_velocity=0.0, a=a, u_new=u_new))
            secs = [self.path.section(wm.M_DENSE, part, p.b.numel)
                    for p, part in zip(pieces, _cut(coded, pieces))]
            return secs, _lossy(delivered, coded), None
        if coded_whole(b):
            return self._coded(b, pieces, a, u_new)
        t_sel = time.perf_counter()
        w = self.layout.read_params(b, torch.empty_like(a)) if cfg.magnitude_weight else None
        secs, sels, delivered, left = [], [], [], []
        keep_left = self.memory[b.index].takes_left(b.k)
        for p, ap in zip(pieces, _cut(a, pieces)):
            pb = p.b
            core = self._select_core(pb, ap, None if w is None else w[p.lo:p.hi]).to(b.device)
            # Kept only where this rank serves the piece: its server regenerates the set.
            sel = slice_indices(pb.numel, core, pb.k_explore, seed=cfg.seed, role=ROLE_PUSH,
                                rank=self.rank, step=t, bucket=pb.index, device=b.device,
                                keep=self.shards.roots[p.shard] == self.rank)
            t_code = time.perf_counter()
            # value_bits: the values travel in the slice dtype; what rounding lost stays in the
            # residual (``delivered`` is what the server decodes), to be sent later.
            sent = ap.index_select(0, sel)
            coded, exp, got = quantize(sent, pb.slice_dtype, pb.slice_bits)
            secs.append(self.path.section(wm.M_SLICE, coded, pb.numel, indices=core, exp=exp))
            sels.append(sel + p.lo if p.lo else sel)
            delivered.append(got)
            if got is not None and keep_left:
                left.append(sent.sub_(got))   # its coded copy is made: sent is free
            t_sel += time.perf_counter() - t_code   # select_seconds: selection alone
        self.stats.select_seconds += time.perf_counter() - t_sel
        sel = sels[0] if len(sels) == 1 else torch.cat(sels)
        lossy = None
        if delivered[0] is not None:
            lossy = (delivered[0] if len(delivered) == 1 else torch.cat(delivered), coded.dtype)
        self._pending.append(Proposal(index=b.index, sel=sel,
                                      delivered=None if lossy is None else lossy[0],
                                      mask_velocity=cfg.momentum_masking, a=a, u_new=u_new,
                                      left=(left[0] if len(left) == 1 else torch.cat(left))
                                      if left else None))
        return secs, lossy, sel

    def _coded(self, b: Bucket, pieces: List[Piece], a: torch.Tensor,
               u_new: Optional[torch.Tensor]
               ) -> Tuple[List[wm.Section], Optional[Lossy], Optional[torch.Tensor]]:
        """Every coordinate's sign (``value_bits=1`` at ``density=1.0``), each piece at its own
        scale; what the signs lose stays in the residual, and the velocity is not masked (as in
        a dense warm-up step: masking every coordinate every step would cancel the momentum)."""
        secs, got = [], []
        for p, part in zip(pieces, _cut(a, pieces)):
            coded, _, delivered = quantize(part, p.b.slice_dtype, p.b.slice_bits)
            secs.append(self.path.section(wm.M_CODED, coded, p.b.numel))
            got.append(delivered)
        delivered = got[0] if len(got) == 1 else torch.cat(got)
        self._pending.append(Proposal(index=b.index, sel=None, delivered=delivered,
                                      mask_velocity=0.0, a=a, u_new=u_new))
        return secs, (delivered, coded.dtype), None

    def _select_core(self, pb: Bucket, a: torch.Tensor, w: Optional[torch.Tensor]
                     ) -> torch.Tensor:
        """The ``k_core`` most significant coordinates of a piece's ``a`` (docs/design.md §2);
        ``w``: its parameters, when ``magnitude_weight`` weighs them in."""
        lam, selector = self.cfg.magnitude_weight, self.selector[pb.index]
        # Under "propagate" a NaN/Inf goes out first, as a dense allreduce would carry it.
        first = self.cfg.nonfinite == "propagate"
        if lam == 0:   # |a| alone: selected without writing a score buffer
            return selector.select_magnitude(a, pb.k_core, nonfinite_first=first)
        score = self._score.get(pb.index)
        if score is None:
            score = self._score[pb.index] = torch.empty_like(a)
        return selector.select(significance(a, w, lam, out=score), pb.k_core,
                               nonfinite_first=first)

    # --- pull and apply (pull.py) -----------------------------------------------------------
    def read_pulls(self, bufs: List[Any], t: int, flush: bool
                   ) -> Optional[List[List[wm.Section]]]:
        """Every server's reply read strictly (:meth:`Puller.read`): the pulled sections per
        shard, or None for a step every rank skips; an ERROR reply raises."""
        return self.puller.read(bufs, t, flush)

    def apply(self, pulled: List[List[wm.Section]], t: int, rendered: Any = None) -> None:
        """The step went through: commit this rank's proposals, then write the pulled values
        into ``p.grad`` (:meth:`Puller.write`; ``rendered``: its render of them)."""
        self._commit()
        self.puller.write(pulled, t, rendered, self.scale)

    def render(self, pulled: List[List[wm.Section]], t: int) -> Any:
        """What the pull delivers, before the commit (:meth:`Puller.render`, at this step's
        loss scale), for :meth:`apply` to write."""
        return self.puller.render(pulled, t, self.scale)

    # --- the step's outcome on this rank's memory --------------------------------------------
    def selector_states(self) -> Dict[int, dict]:
        """The selectors' carried thresholds, for :meth:`rollback`."""
        return {i: s.state_dict() for i, s in self.selector.items()}

    def _commit(self) -> None:
        """The step went through: forget what was sent."""
        for p in self._pending:
            mem = self.memory[p.index]
            if p.a is None:
                mem.update(p.sel, p.delivered, p.mask_velocity)
                continue
            self._flat[p.index] = mem.commit(p.a, p.u_new, p.sel, p.delivered, p.mask_velocity,
                                             p.left)
        self._pending = []

    def absorb(self) -> None:
        """The step failed: keep what was computed (nothing was delivered), so nothing is lost."""
        empty = torch.empty(0, dtype=torch.int64)
        for p in self._pending:
            if p.a is not None:
                mem = self.memory[p.index]
                self._flat[p.index] = mem.commit(p.a, p.u_new, empty.to(p.a.device))
        self._pending = []

    def rollback(self, selectors: Dict[int, dict]) -> None:
        """Every rank drops the step (NaN/Inf): no residual or velocity changes."""
        self._pending = []
        for i, st in selectors.items():
            self.selector[i].load_state_dict(st)

    def flag_grads(self) -> None:
        """A step every rank skipped under ``nonfinite="flag"``: every gradient becomes NaN.

        The same on every rank, whichever rank (or the server) found the NaN/Inf, so that a
        ``torch.amp.GradScaler`` on each rank finds it (``found_inf``), skips its step and
        lowers its scale alike; the replicas stay identical. Nothing of the exchange changes."""
        for b in self.layout.buckets:
            nan = torch.full((b.numel,), float("nan"), dtype=b.dtype, device=b.device)
            self.layout.write_grads(b, nan)

    def drop_pending(self) -> None:
        """Forget the step in flight without touching the memory (a failed flush, whose
        residuals are all still in place, or a loaded checkpoint)."""
        self._pending = []


def _cut(values: torch.Tensor, pieces: List[Piece]) -> List[torch.Tensor]:
    """``values`` (a whole bucket's) as the pieces' parts: itself when there is one piece."""
    if len(pieces) == 1 and pieces[0].lo == 0 and pieces[0].hi == values.numel():
        return [values]
    return [values[p.lo:p.hi] for p in pieces]
