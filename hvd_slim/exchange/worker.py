"""The worker's side of a step, for one rank: compensate and select (speculatively), read the
server's pull and apply it, and settle the outcome on this rank's memory.

A :class:`Worker` is handed everything it reads when it is built (layout, settings, rank, world
size, digest, the :class:`~hvd_slim.exchange.wirepath.WirePath` its sections take and the
stats it adds to) and owns this rank's residuals, selectors and cached cores.
:class:`~hvd_slim.exchange.step.SlimExchange` calls it phase by phase.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..config import SlimConfig
from ..memory import ResidualMemory
from ..selection import ROLE_PULL, ROLE_PUSH, CoreSelector, significance, slice_indices
from ..wire import control
from ..wire import message as wm
from ..wire.values import quantize
from .errors import ExchangeError, NonFiniteGradientError
from .expect import is_refresh, pull_expect
from .finite import nonfinite_params, nonfinite_sent, nonfinite_text
from .layout import DENSE, Bucket, Layout, sent_whole
from .sections import indices_on, section_values
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
    core: Optional[torch.Tensor] = None    # a freshly selected core, cached once committed


@dataclass
class Compensated:
    """What the compensate phase hands to select: each bucket's proposed ``(a, u_new)`` (a dense
    bucket's flat gradient and None), or, when a value is NaN/Inf, nothing and a report naming
    the tensors."""

    proposed: List[Tuple[torch.Tensor, Optional[torch.Tensor]]]
    report: Optional[str] = None


class Worker:
    """One rank's worker state (residuals, selectors, cached push and pull cores) and its
    phases of a step."""

    def __init__(self, layout: Layout, config: SlimConfig, rank: int, size: int, digest: int,
                 path: WirePath, stats: ExchangeStats,
                 momentum: Optional[Dict[int, dict]] = None) -> None:
        self.layout, self.cfg, self.path, self.stats = layout, config, path, stats
        self.rank, self.size, self.digest = rank, size, digest
        momentum = momentum or {}
        self.memory = {b.index: ResidualMemory(b.numel, b.dtype, b.device,
                                               **momentum.get(b.index, {}))
                       for b in layout.sparse}
        self.selector = {b.index: CoreSelector() for b in layout.sparse}
        self.core: Dict[int, torch.Tensor] = {}        # this worker's cached push cores
        self.pull_core: Dict[int, torch.Tensor] = {}   # the server's cached pull cores
        self._flat = {b.index: torch.zeros(b.numel, dtype=b.dtype, device=b.device)
                      for b in layout.buckets}
        self._score: Dict[int, torch.Tensor] = {}   # only with magnitude_weight > 0
        self._pulled: Dict[int, torch.Tensor] = {}  # sliced pulls; each p.grad views it
        self._pending: List[Proposal] = []

    # --- compensate and select ---------------------------------------------------------------
    def compensate(self, t: int) -> Compensated:
        """Every bucket's proposed ``a = r + u`` read straight from the ``.grad``s (speculative:
        no memory changes), or (a NaN/Inf, unless nonfinite is "propagate") a report instead."""
        self._pending = []
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
               ) -> Tuple[List[wm.Section], Optional[str]]:
        """Every bucket's push section, or (NaN/Inf found by compensate, or made by a lossy
        coding, and nonfinite is not "propagate") no sections and a report naming the
        tensors."""
        if compensated.report is not None:
            return [], compensated.report
        check = self.cfg.nonfinite != "propagate"
        sections, overflow, sent_dtype = [], [], None
        for b, (x, u_new) in zip(self.layout.at_step(t), compensated.proposed):
            sec, lossy, sel = self._select(b, t, x, u_new)
            if check and lossy is not None:   # what a lossy coding made of the values
                found = nonfinite_sent(b, lossy[0], sel)
                overflow, sent_dtype = overflow + found, (lossy[1] if found else sent_dtype)
            sections.append(sec)
        if overflow:
            return [], nonfinite_text(overflow, overflow=True, sent_dtype=sent_dtype)
        return sections, None

    def flush_sections(self) -> List[wm.Section]:
        """Every residual as a dense section (dense buckets send nothing), pending until the
        flush's pull says it went through."""
        self._pending = []
        sections = []
        for b in self.layout.buckets:
            if b.kind == DENSE:
                sections.append(self.path.empty())
                continue
            values = self.memory[b.index].residual.to(b.comm_dtype, copy=True)
            delivered = values.to(b.dtype) if b.comm_dtype != b.dtype else None
            # Nothing is masked: the velocity stays (a flush sends residuals, not momentum).
            self._pending.append(Proposal(index=b.index, sel=None, delivered=delivered,
                                          mask_velocity=0.0))
            sections.append(self.path.section(wm.M_DENSE, values, b.numel))
        return sections

    def _fold(self, b: Bucket) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """A dense bucket's flat gradient, or a compressed bucket's proposed ``(a, u_new)``
        computed straight from each parameter's ``.grad`` (speculative: nothing changes yet)."""
        flat, f = self._flat[b.index], self.cfg.gradient_predivide_factor
        scaled = self.cfg.op == "average" and f != 1.0
        if b.kind == DENSE or scaled:
            g = self.layout.read_grads(b, flat)
            if scaled:
                g.div_(f)
            return (g, None) if b.kind == DENSE else self.memory[b.index].propose(g)
        return self.memory[b.index].propose_parts(self.layout.grad_parts(b), flat)

    def _select(self, b: Bucket, t: int, a: torch.Tensor, u_new: Optional[torch.Tensor]
                ) -> Tuple[wm.Section, Optional[Lossy], Optional[torch.Tensor]]:
        """This bucket's section; the values a lossy coding delivers (and its dtype), for
        the overflow check; and the coordinates sent (None: all)."""
        cfg = self.cfg
        if b.kind == DENSE:
            coded, _, delivered = quantize(a, b.comm_dtype)
            return self.path.section(wm.M_DENSE, coded, b.numel), _lossy(delivered, coded), None
        if sent_whole(b):
            # A dense warm-up step: all of a goes, and the velocity is not masked (masking every
            # coordinate every step would cancel the momentum): dense momentum SGD exactly.
            coded, _, delivered = quantize(a, b.comm_dtype)
            self._pending.append(Proposal(index=b.index, sel=None, delivered=delivered,
                                          mask_velocity=0.0, a=a, u_new=u_new))
            return self.path.section(wm.M_DENSE, coded, b.numel), _lossy(delivered, coded), None
        t_sel = time.perf_counter()
        new_core = None
        if is_refresh(t, cfg.refresh_interval) or b.index not in self.core:
            new_core = self._select_core(b, a)
        core = (self.core[b.index] if new_core is None else new_core).to(b.device)
        sel = slice_indices(b.numel, core, b.k_explore, seed=cfg.seed, role=ROLE_PUSH,
                            rank=self.rank, step=t, bucket=b.index, device=b.device)
        self.stats.select_seconds += time.perf_counter() - t_sel
        # value_bits: the values travel in the slice dtype; what rounding lost stays in the
        # residual (``delivered`` is what the server decodes), to be sent later.
        coded, exp, delivered = quantize(a[sel], b.slice_dtype)
        self._pending.append(Proposal(index=b.index, sel=sel, delivered=delivered,
                                      mask_velocity=cfg.momentum_masking, a=a, u_new=u_new,
                                      core=new_core))
        if is_refresh(t, cfg.refresh_interval):
            sec = self.path.section(wm.M_SLICE, coded, b.numel, indices=core, exp=exp)
        else:
            sec = self.path.section(wm.M_SLICE_CACHED, coded, b.numel, exp=exp)
        return sec, _lossy(delivered, coded), sel

    def _select_core(self, b: Bucket, a: torch.Tensor) -> torch.Tensor:
        """The ``k_core`` most significant coordinates of ``a`` (docs/design.md §2)."""
        lam, selector = self.cfg.magnitude_weight, self.selector[b.index]
        if lam == 0:   # |a| alone: selected without writing a score buffer
            return selector.select_magnitude(a, b.k_core)
        score = self._score.get(b.index)
        if score is None:
            score = self._score[b.index] = torch.empty_like(a)
        w = self.layout.read_params(b, torch.empty_like(a))
        return selector.select(significance(a, w, lam, out=score), b.k_core)

    # --- pull and apply ----------------------------------------------------------------------
    def read_pull(self, buf: Any, t: int, flush: bool) -> Optional[List[wm.Section]]:
        """The server's reply decoded strictly: the pulled sections, or None for a step every
        rank skips. An ERROR reply raises its text (as NonFiniteGradientError for a NaN/Inf
        under nonfinite="raise"), as does a malformed one (ExchangeError)."""
        who = "pull from the server"
        try:
            if not flush and self.path.peek(buf, who) == wm.SKIP:
                self.stats.last_skip = control.decode_text(
                    self.path.host(buf), kind=wm.SKIP, sender=self.cfg.server_rank, step=t,
                    digest=self.digest, who=who)
                return None
            # The world size bounds a union pull: at most ``size * k`` coordinates a bucket.
            expect = pull_expect(self.layout.at_step(t), t, self.cfg.refresh_interval,
                                 self.cfg.pull, flush, size=self.size)
            return self.path.decode(buf, kind=wm.FLUSH_PULL if flush else wm.PULL,
                                    sender=self.cfg.server_rank, step=t, digest=self.digest,
                                    expect=expect, who=who)
        except wm.RemoteError as exc:
            if exc.code == wm.E_NONFINITE:
                raise NonFiniteGradientError(str(exc)) from None
            raise ExchangeError(str(exc)) from None
        except wm.WireError as exc:
            raise ExchangeError(f"rank {self.rank}: {exc}") from None

    def apply(self, sections: List[wm.Section], t: int) -> None:
        """The step went through: commit this rank's proposals, then write the pulled values
        into ``p.grad`` (zeros where nothing was delivered; dense sections straight in)."""
        self._commit()
        for b, sec in zip(self.layout.at_step(t), sections):
            if sec.mode == wm.M_EMPTY:
                continue
            vals = section_values(sec, b)
            if sec.mode == wm.M_DENSE:
                self.layout.write_grads(b, vals)
                continue
            idx = self._pull_indices(b, sec, t)
            # The pull is scattered into a buffer this rank keeps, and each p.grad becomes a view
            # of it (as DDP's gradient_as_bucket_view): no copy into separate .grad tensors.
            flat = self._pulled.get(b.index)
            if flat is None:
                flat = self._pulled[b.index] = torch.zeros(b.numel, dtype=b.dtype,
                                                           device=b.device)
            else:
                flat.zero_()
            flat[idx] = vals
            self.layout.point_grads(b, flat)

    def _pull_indices(self, b: Bucket, sec: wm.Section, t: int) -> torch.Tensor:
        """The coordinates of a pulled slice: explicit, or the server's core plus exploration."""
        if sec.mode == wm.M_EXPLICIT:
            return indices_on(sec.indices, b)
        if sec.mode == wm.M_SLICE:
            self.pull_core[b.index] = indices_on(sec.indices, b)
        core = self.pull_core.get(b.index)
        if core is None:
            raise ExchangeError(f"rank {self.rank}: the server reused a cached pull core this "
                                "rank does not have")
        return slice_indices(b.numel, core, b.k_pull_explore, seed=self.cfg.seed,
                             role=ROLE_PULL, rank=self.cfg.server_rank, step=t,
                             bucket=b.index, device=b.device)

    # --- the step's outcome on this rank's memory --------------------------------------------
    def selector_states(self) -> Dict[int, dict]:
        """The selectors' carried thresholds, for :meth:`rollback`."""
        return {i: s.state_dict() for i, s in self.selector.items()}

    def _commit(self) -> None:
        """The step went through: forget what was sent, cache fresh cores."""
        for p in self._pending:
            mem = self.memory[p.index]
            if p.a is None:
                mem.update(p.sel, p.delivered, p.mask_velocity)
                continue
            self._flat[p.index] = mem.commit(p.a, p.u_new, p.sel, p.delivered, p.mask_velocity)
            if p.core is not None:
                self.core[p.index] = p.core
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
        """Every rank drops the step (NaN/Inf): no residual, velocity or core changes."""
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

