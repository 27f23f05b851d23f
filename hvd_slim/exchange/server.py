"""The server's half of a step: decode every push, aggregate, choose the pull slice.

The server is rank ``server_rank`` (also a worker). Every push is decoded strictly before
anything is summed, and the server's own state (its residual, its selectors) changes only once
the whole pull is built, so a bad message or a skipped step leaves it untouched.

It also decides how a step with a NaN/Inf gradient ends: any worker that found one sends a
NONFINITE report instead of its push, and the server answers every rank with one verdict, SKIP
(``nonfinite="flag"`` or ``"skip"``) or an ERROR every rank raises (``"raise"``). The decision thus travels in
the pull and costs nothing on a healthy step.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ..config import SlimConfig
from ..memory import ResidualMemory
from ..selection import ROLE_PULL, ROLE_PUSH, CoreSelector, slice_indices, tie_start
from ..wire import control
from ..wire import message as wm
from ..wire.indices import index_bytes_bound
from ..wire.values import quantize
from .expect import pull_is_dense, push_expect
from .finite import nonfinite_sent, nonfinite_text
from .layout import DENSE, Bucket, Layout, coded_pull, coded_whole
from .sections import indices_on, itemsizes, section_values
from .wirepath import HostPath, WirePath


class Server:
    """Aggregation state: its own residual ``e`` per compressed bucket (pull="slim") and the
    selector of its pull."""

    def __init__(self, layout: Layout, config: SlimConfig, size: int, rank: int,
                 path: Optional[WirePath] = None) -> None:
        self.layout, self.cfg, self.size, self.rank = layout, config, size, rank
        # Messages as numpy or as device tensors: the path's choice, never asked here.
        self.path: WirePath = HostPath() if path is None else path
        # The server's state lives beside the parameters: on a GPU, aggregation, selection and
        # the pull's encoding all stay there.
        self.memory = {b.index: ResidualMemory(b.numel, b.state_dtype, b.device)
                       for b in layout.sparse}
        self.selector = {b.index: CoreSelector() for b in layout.sparse}
        # Kept per-bucket scratch: fresh multi-MB buffers are page-faulted in again every step
        # (profiled: ~23% of the server's exchange time on ResNet-18 shapes).
        self._total: Dict[int, torch.Tensor] = {}
        # sparse_average="senders": per compressed bucket, how many ranks sent each coordinate
        # this step (zero between steps: cleared where it was touched).
        self._senders: Dict[int, torch.Tensor] = {}
        self._touched: Dict[int, torch.Tensor] = {}
        # What serve() planned, applied by settle() once every shard's reply is known.
        self._pending: Optional[Tuple["_Plan", Dict[int, torch.Tensor], Dict[int, dict]]] = None

    def _zeroed(self, cache: Dict[int, torch.Tensor], b: Bucket, dtype: torch.dtype
                ) -> torch.Tensor:
        buf = cache.pop(b.index, None)
        if buf is None:
            return torch.zeros(b.numel, dtype=dtype, device=b.device)
        return buf.zero_()

    # --- aggregate -------------------------------------------------------------------------
    def serve(self, payloads: List[Any], step: int, digest: int, flush: bool = False,
              limit: Optional[int] = None) -> Any:
        """Aggregate ``payloads`` (rank order) and return the pull (or SKIP/ERROR verdict) to
        broadcast; ``limit`` is the pull's byte bound, which a verdict's text is cut to. A pull
        changes nothing yet: :meth:`settle` commits it once the step's outcome is known."""
        self.settle(False)   # a step whose outcome never arrived did not go through
        cfg, buckets = self.cfg, self.layout.at_step(step)
        kind = wm.FLUSH_PUSH if flush else wm.PUSH
        expect = push_expect(buckets, flush)
        decoded: List[Optional[List[wm.Section]]] = []
        reports: List[Tuple[int, str]] = []
        for j, buf in enumerate(payloads):
            who = f"push from rank {j}"
            if self.path.is_error(buf):
                raise wm.WireError(f"{who}: an error message where a push belongs")
            if not flush and self.path.peek(buf, who) == wm.NONFINITE:
                reports.append((j, control.decode_text(self.path.host(buf), kind=wm.NONFINITE,
                                                       sender=j, step=step, digest=digest,
                                                       who=who)))
                decoded.append(None)
                continue
            decoded.append(self.path.decode(buf, kind=kind, sender=j, step=step, digest=digest,
                                            expect=expect, who=who))
        if reports:
            return self._verdict(reports, step, digest, limit)
        scale = 1.0 if cfg.op == "sum" else cfg.gradient_predivide_factor / self.size
        selectors = {i: s.state_dict() for i, s in self.selector.items()}
        plan = _Plan()
        sections, totals = [], {}
        try:
            # A message's sections follow its buckets' order (a shard's pieces are numbered
            # otherwise): section ``pos`` of every push is bucket ``pos`` of ``buckets``.
            for pos, b in enumerate(buckets):
                secs = [d[pos] for d in decoded]
                if b.kind != DENSE and cfg.pull == "slim" and not flush and not pull_is_dense(b):
                    sections.append(self._slim_section(b, secs, step, scale, plan))
                    continue
                total = totals[b.index] = self._zeroed(
                    self._total, b, b.dtype if b.kind == DENSE else b.state_dtype)
                touched = None
                if cfg.pull == "union":
                    touched = self._touched[b.index] = self._zeroed(self._touched, b, torch.bool)
                senders = None
                if cfg.sparse_average == "senders" and b.kind != DENSE and not flush:
                    # zeroed first as well: a step that failed half-way may have left counts
                    senders = self._sender_count(b, total).zero_()
                for j in range(self.size):
                    self._accumulate(b, j, secs[j], step, total, touched, plan, senders)
                if senders is not None:   # a pull as dense as the push: every coordinate's
                    total.div_(senders.clamp_(min=1.0))   # senders (0 where none sent)
                    total.mul_(scale * self.size)
                    senders.zero_()
                elif scale != 1.0:
                    total.mul_(scale)
                sections.append(self._pull_section(b, total, touched, step, flush, plan))
        except BaseException:
            plan.undo()
            raise
        if plan.overflow and cfg.nonfinite != "propagate" and not flush:
            plan.undo()
            for i, st in selectors.items():
                self.selector[i].load_state_dict(st)
            text = f"the server's aggregate: {nonfinite_text(plan.overflow, True, plan.sent_dtype)}"
            return self._verdict([(self.rank, text)], step, digest, limit)
        try:
            out = self.path.encode(wm.FLUSH_PULL if flush else wm.PULL, self.rank, step, digest,
                                   sections,
                                   itemsizes([b.as_pulled() for b in buckets], sections))[0]
        except BaseException:
            plan.undo()
            raise
        self._pending = (plan, totals, selectors)
        return out

    def settle(self, ok: bool) -> None:
        """The outcome of the step last served: ``ok`` (every shard's reply was a pull) commits
        what :meth:`serve` planned; otherwise (a shard skipped or failed, or the replies never
        arrived) it is undone exactly, selectors included. Nothing to do after a verdict."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        plan, totals, selectors = pending
        if ok:
            adopted = plan.commit()
        else:
            plan.undo()
            for i, st in selectors.items():
                self.selector[i].load_state_dict(st)
            adopted = {}
        # encode() copied every section: the aggregate buffers are free again. A residual that
        # adopted a bucket's aggregate handed back its old buffer instead.
        for index, total in totals.items():
            self._total[index] = adopted.get(id(self.memory.get(index)), total)

    def _verdict(self, reports: List[Tuple[int, str]], step: int, digest: int,
                 limit: Optional[int]) -> Any:
        """SKIP or ERROR for a step with non-finite values; nothing of the server has changed."""
        where = "; ".join(f"rank {j}: {text}" for j, text in reports)
        mode = self.cfg.nonfinite
        if mode in ("skip", "flag"):   # "flag": each worker then fills its grads with NaN
            return self.path.from_host(control.encode_text(
                wm.SKIP, self.rank, step, digest,
                f"step {step} skipped on every rank (nonfinite={mode!r}): {where}", limit=limit))
        return self.path.from_host(wm.encode_error(
            self.rank, step, f"hvd_slim: non-finite gradient at step {step} (nonfinite='raise'): "
            f"{where}. No rank's parameters, residuals or optimizer state changed. Find the "
            "source (torch.autograd.set_detect_anomaly, a lower learning rate, gradient "
            "clipping), or skip such steps: nonfinite='flag' (HVD_SLIM_NONFINITE=flag, the "
            "default, for torch.amp.GradScaler) or nonfinite='skip'",
            code=wm.E_NONFINITE, limit=limit))

    def _slim_section(self, b: Bucket, secs: List[wm.Section], step: int,
                      scale: float, plan: "_Plan") -> wm.Section:
        """pull="slim" on a compressed bucket, aggregated straight into the server's residual:
        ``e += scale * push_j`` at each push's coordinates only, instead of summing into a
        zeroed dense buffer and adding ``e`` (three full passes fewer). ``e``'s old values
        there are kept in the plan, so a step that does not go through restores them exactly."""
        e = self.memory[b.index].residual
        if coded_whole(b):   # every rank sent every coordinate: senders are all N ranks
            plan.saved.append((e, None, e.clone()))
            for sec in secs:
                e.add_(section_values(sec, b, b.numel).to(e.dtype), alpha=scale)
            return self._slice_pull(b, e, step, plan)
        pushes = [self._push_slice(b, j, secs[j], step, plan)
                  for j in range(self.size)]
        touched = torch.cat([idx for idx, _ in pushes])
        plan.saved.append((e, touched, e.index_select(0, touched)))
        if self.cfg.sparse_average == "senders":
            self._add_over_senders(b, e, pushes, touched, scale * self.size)
        else:
            for idx, vals in pushes:
                e.index_add_(0, idx, vals.to(e.dtype), alpha=scale)
        return self._slice_pull(b, e, step, plan)

    def _add_over_senders(self, b: Bucket, e: torch.Tensor,
                          pushes: List[Tuple[torch.Tensor, torch.Tensor]],
                          touched: torch.Tensor, scale: float) -> None:
        """``e += scale * push_j / senders`` at each push's coordinates, ``senders`` counting
        the ranks whose slice held each coordinate (sparse_average="senders"): O(k N), the
        count kept zero between steps by clearing only what was touched."""
        count = self._sender_count(b, e)
        count.index_add_(0, touched, torch.ones(touched.numel(), dtype=e.dtype,
                                                device=e.device))
        try:
            for idx, vals in pushes:
                e.index_add_(0, idx, vals.to(e.dtype) / count.index_select(0, idx),
                             alpha=scale)
        finally:
            count.index_fill_(0, touched, 0.0)

    def _sender_count(self, b: Bucket, like: torch.Tensor) -> torch.Tensor:
        """``b``'s count of senders per coordinate (sparse_average="senders"), in ``like``'s
        dtype and device: all zeros between steps, which each user restores."""
        count = self._senders.get(b.index)
        if count is None:
            count = self._senders[b.index] = torch.zeros(b.numel, dtype=like.dtype,
                                                         device=like.device)
        return count

    def _push_slice(self, b: Bucket, j: int, sec: wm.Section, step: int, plan: "_Plan"
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The coordinates (core, then exploration) and values of rank ``j``'s sliced push."""
        # A regeneration: its own push's set is found kept; nothing asks for any of them again.
        idx = slice_indices(b.numel, indices_on(sec.indices, b), b.k_explore,
                            seed=self.cfg.seed, role=ROLE_PUSH, rank=j, step=step,
                            bucket=b.index, device=b.device, keep=False)
        return idx, section_values(sec, b, idx.numel())

    def _accumulate(self, b: Bucket, j: int, sec: wm.Section, step: int, total: torch.Tensor,
                    touched: Optional[torch.Tensor], plan: "_Plan",
                    senders: Optional[torch.Tensor] = None) -> None:
        if sec.mode == wm.M_EMPTY:
            return
        if sec.mode in (wm.M_DENSE, wm.M_CODED):
            total.add_(section_values(sec, b, b.numel).to(total.dtype))
            if touched is not None:
                touched.fill_(True)
            if senders is not None:
                senders.add_(1.0)
            return
        idx, vals = self._push_slice(b, j, sec, step, plan)
        total.index_add_(0, idx, vals.to(total.dtype))
        if touched is not None:
            touched[idx] = True
        if senders is not None:
            senders.index_add_(0, idx, torch.ones(idx.numel(), dtype=senders.dtype,
                                                  device=senders.device))

    # --- pull ------------------------------------------------------------------------------
    def _pull_section(self, b: Bucket, total: torch.Tensor, touched: Optional[torch.Tensor],
                      step: int, flush: bool, plan: "_Plan") -> wm.Section:
        if b.kind == DENSE:
            if flush:
                return self.path.empty()
            return self._sent(b, total, None, plan, wm.M_DENSE)
        if self.cfg.pull == "union" and not flush:
            # The exact aggregate: at the comm dtype (not value_bits), as nothing keeps a
            # rounding error here.
            idx = touched.nonzero().reshape(-1)
            n = idx.numel()
            if n * b.value_bytes + index_bytes_bound(b.numel, n) < b.numel * b.value_bytes:
                return self._sent(b, total.index_select(0, idx), idx, plan, wm.M_EXPLICIT,
                                  idx)
            return self._sent(b, total, None, plan, wm.M_DENSE)
        # A flush, or a pull slice no smaller than dense (a sliced pull goes _slim_section).
        mem = self.memory[b.index]
        v = total.add_(mem.residual)   # e + G, proposed: e itself changes only at commit
        if coded_pull(b) and not flush:   # every coordinate at pull_value_bits: coded copies
            pb = b.as_pulled()
            coded, exp, delivered = quantize(v, pb.slice_dtype, pb.slice_bits)
            plan.memory.append((mem, v, None, delivered))
            return self._checked(b, coded, delivered, None, plan, wm.M_CODED, None, exp)
        # Sent as a copy, since commit zeroes v's buffer.
        coded, _, delivered = quantize(v.clone() if v.dtype == b.comm_dtype else v, b.comm_dtype)
        plan.memory.append((mem, v, None, delivered))
        return self._checked(b, coded, delivered, None, plan, wm.M_DENSE)

    def _slice_pull(self, b: Bucket, v: torch.Tensor, step: int, plan: "_Plan") -> wm.Section:
        """The pull slice of ``v`` (= e + G, the residual itself): its core by |v| plus
        exploration; the sent coordinates are forgotten at commit."""
        mem, selector = self.memory[b.index], self.selector[b.index]
        # Ties at the threshold (the sum of a few float8 or 2-bit pushes sits on a coarse grid)
        # are taken from a start that changes every step, not by lowest index every time.
        pb = b.as_pulled()
        # When v holds fewer non-zeros than the core (a warm-up's pull twice a lone push, say),
        # the core would be them all filled up with zeros, and exploration would add only
        # zeros: at an unpacked value_bits those deliver nothing, so the non-zeros go alone.
        # Under nonfinite="propagate" a NaN/Inf in e goes out first (as a dense allreduce
        # would carry it), and the set is never short.
        propagate = self.cfg.nonfinite == "propagate"
        core = selector.select_magnitude(
            v, b.k_pull_core, ties=tie_start((self.cfg.seed, step, b.index)),
            short=not pb.slice_bits and not propagate, nonfinite_first=propagate)
        if core.numel() < min(b.k_pull_core, b.numel):
            sent = v.index_select(0, core)
            coded, exp, delivered = quantize(sent, pb.slice_dtype, 0)
            plan.forget.append((mem, core, delivered, _left(mem, core, sent, delivered)))
            return self._checked(b, coded, delivered, core, plan, wm.M_SHORT, core, exp)
        sel = slice_indices(b.numel, core, b.k_pull_explore, seed=self.cfg.seed,
                            role=ROLE_PULL, rank=self.rank, step=step, bucket=b.index,
                            device=b.device)
        # pull_value_bits: what rounding loses stays in the server's residual (forgotten:
        # delivered).
        # index_select: 3-4x faster than v[sel] on a CPU (no advanced-indexing machinery)
        sent = v.index_select(0, sel)
        coded, exp, delivered = quantize(sent, pb.slice_dtype, pb.slice_bits)
        plan.forget.append((mem, sel, delivered, _left(mem, sel, sent, delivered)))
        return self._checked(b, coded, delivered, sel, plan, wm.M_SLICE, core, exp)

    def _sent(self, b: Bucket, values: torch.Tensor, sel: Optional[torch.Tensor], plan: "_Plan",
              mode: int, indices: Optional[torch.Tensor] = None) -> wm.Section:
        """The section carrying ``values`` in the bucket's comm dtype (dense, or the union)."""
        coded, _, delivered = quantize(values, b.comm_dtype)
        return self._checked(b, coded, delivered, sel, plan, mode, indices)

    def _checked(self, b: Bucket, coded: torch.Tensor, delivered: Optional[torch.Tensor],
                 sel: Optional[torch.Tensor], plan: "_Plan", mode: int,
                 indices: Optional[torch.Tensor] = None, exp: int = 0) -> wm.Section:
        """The section for ``coded``; what a lossy coding delivers is checked for overflow
        (cheaply)."""
        if delivered is not None and self.cfg.nonfinite != "propagate":
            bad = nonfinite_sent(b, delivered, sel)
            if bad:
                plan.overflow += bad
                plan.sent_dtype = coded.dtype
        return self.path.section(mode, coded, b.numel, indices, exp)

    # --- checkpoint --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"memory": {i: m.state_dict() for i, m in self.memory.items()},
                "selector": {i: s.state_dict() for i, s in self.selector.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Load a state the exchange's checkpoint checks validated (the same job and layout;
        the cached cores of older checkpoints are ignored: every step selects anew)."""
        for i, m in self.memory.items():
            m.load_state_dict(state["memory"][i])
            self.selector[i].load_state_dict(state["selector"][i])


def _left(mem: ResidualMemory, sel: torch.Tensor, sent: torch.Tensor,
          delivered: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """What stays at ``sel`` once ``delivered`` of the values gathered there (``sent``, reused)
    goes: the commit writes it with one scatter instead of an indexed subtraction, where the
    memory takes it (:meth:`ResidualMemory.takes_left`)."""
    if delivered is None or not mem.takes_left(sel.numel()):
        return None
    return sent.sub_(delivered)


class _Plan:
    """What a step will change in the server, applied only when the whole pull is built."""

    def __init__(self) -> None:
        self.memory: List[tuple] = []        # (memory, proposed residual, sent, delivered)
        # (memory, sent, delivered, what stays there or None): aggregated in place
        self.forget: List[tuple] = []
        # (residual, coordinates or None for all of them, their values before)
        self.saved: List[tuple] = []
        self.overflow: List[str] = []        # parameters whose pulled values overflow the wire
        self.sent_dtype: Optional[torch.dtype] = None

    def commit(self) -> Dict[int, torch.Tensor]:
        """Apply the plan; returns each adopting memory's old residual buffer, by id(memory)."""
        old = {}
        for mem, v, sent, delivered in self.memory:
            old[id(mem)] = mem.commit(v, None, sent, delivered)
        for mem, sent, delivered, left in self.forget:
            mem.update(sent, delivered, left=left)
        self.saved = []
        return old

    def undo(self) -> None:
        """The step does not go through: give residuals aggregated in place their old values
        back (exactly; a coordinate two pushes touched was saved twice, with the same value)."""
        for e, idx, before in reversed(self.saved):
            if idx is None:   # all of it was saved (a coded push touches every coordinate)
                e.copy_(before)
            else:
                e.index_put_((idx,), before)
        self.saved = []

