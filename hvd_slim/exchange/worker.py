"""The worker's side of a step: read the gradients, compensate and select (speculatively), and
settle the outcome on this rank's memory once the pull says how the step ended.

Mixed into :class:`~hvd_slim.exchange.step.SlimExchange`, which owns the state used here
(``layout``, ``cfg``, ``memory``, ``selector``, ``core``, ``_flat``, ``_score``, ``_pending``,
and ``path``: the host or device form of the sections, a
:class:`~hvd_slim.exchange.wirepath.WirePath`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ..selection import ROLE_PUSH, significance, slice_indices
from ..wire import message as wm
from ..wire.values import quantize
from .expect import is_refresh
from .finite import describe, nonfinite_params, nonfinite_sent
from .layout import DENSE, Bucket, sent_whole


# The values a lossy wire dtype delivers, and that dtype (for an overflow report).
Lossy = Tuple[torch.Tensor, torch.dtype]


def _lossy(delivered: Optional[torch.Tensor], wire: torch.Tensor) -> Optional[Lossy]:
    return None if delivered is None else (delivered, wire.dtype)


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


class WorkerSide:
    """Compensate/select and commit/absorb/rollback, for one rank."""

    def _compensate_and_select_all(self, t: int) -> Tuple[List[wm.Section], Optional[str]]:
        """Every bucket's section, or (when a value is NaN/Inf and nonfinite is not
        "propagate") a report naming the tensors instead; nothing is folded in then."""
        check = self.cfg.nonfinite != "propagate"
        buckets = self.layout.at_step(t)
        folded, bad = [], []
        for b in buckets:
            x, u_new = self._fold(b)
            # Compressed buckets are checked after folding: residual and velocity are always
            # finite, so a NaN/Inf in ``a`` is one in this step's gradient.
            if check:
                bad += nonfinite_params(b, x)
            folded.append((x, u_new))
        if bad:
            return [], describe(bad, overflow=False)
        sections, overflow, wire_dtype = [], [], None
        for b, (x, u_new) in zip(buckets, folded):
            sec, lossy, sel = self._compensate_and_select(b, t, x, u_new)
            if check and lossy is not None:   # what a lossy wire dtype made of the values
                found = nonfinite_sent(b, lossy[0], sel)
                overflow, wire_dtype = overflow + found, (lossy[1] if found else wire_dtype)
            sections.append(sec)
        if overflow:
            return [], describe(overflow, overflow=True, wire_dtype=wire_dtype)
        return sections, None

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

    def _compensate_and_select(self, b: Bucket, t: int, a: torch.Tensor,
                               u_new: Optional[torch.Tensor]
                               ) -> Tuple[wm.Section, Optional[Lossy], Optional[torch.Tensor]]:
        """This bucket's section; the values a lossy wire dtype delivers (and that dtype), for
        the overflow check; and the coordinates sent (None: all)."""
        cfg = self.cfg
        if b.kind == DENSE:
            wire, _, delivered = quantize(a, b.wire_dtype)
            return self.path.section(wm.M_DENSE, wire, b.numel), _lossy(delivered, wire), None
        if sent_whole(b):
            # A dense warm-up step: all of a goes, and the velocity is not masked (masking every
            # coordinate every step would cancel the momentum): dense momentum SGD exactly.
            wire, _, delivered = quantize(a, b.wire_dtype)
            self._pending.append(Proposal(b.index, None, delivered, False, a, u_new))
            return self.path.section(wm.M_DENSE, wire, b.numel), _lossy(delivered, wire), None
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
        wire, exp, delivered = quantize(a[sel], b.slice_dtype)
        self._pending.append(Proposal(b.index, sel, delivered, cfg.momentum_masking, a, u_new,
                                      new_core))
        if is_refresh(t, cfg.refresh_interval):
            sec = self.path.section(wm.M_SLICE, wire, b.numel, indices=core, exp=exp)
        else:
            sec = self.path.section(wm.M_SLICE_CACHED, wire, b.numel, exp=exp)
        return sec, _lossy(delivered, wire), sel

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

    # --- the step's outcome on this rank's memory --------------------------------------------
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

    def _absorb(self) -> None:
        """The step failed: keep what was computed (nothing was delivered), so nothing is lost."""
        empty = torch.empty(0, dtype=torch.int64)
        for p in self._pending:
            if p.a is not None:
                mem = self.memory[p.index]
                self._flat[p.index] = mem.commit(p.a, p.u_new, empty.to(p.a.device))
        self._pending = []

    def _rollback(self, selectors: Dict[int, dict]) -> None:
        """Every rank drops the step (NaN/Inf): no residual, velocity or core changes."""
        self._pending = []
        for i, st in selectors.items():
            self.selector[i].load_state_dict(st)

