"""Overlap with backward (``overlap=S``, docs/design.md §2 "Overlap").

The trainable parameters, in backward order (the reverse of ``named_parameters``, which is
about the order in which autograd finishes them), are cut into S stages of about equal size.
Each stage is a :class:`SlimExchange` of its own (its residual, selection, server state and
budget: ``density`` of the stage's coordinates, so the step's budget is the same in total), or
with ``hierarchical=True`` a host-first ``HierarchicalExchange`` (exchange/hosts/hierarchy.py, with
its own carry); both meet :class:`~hvd_slim.exchange.protocol.Stage`. A stage's exchange starts on
the communication thread (exchange/overlap/runner.py) as soon as the gradient hook has seen the last
of its parameters' gradients, while backward goes on with the stages before it; ``step()`` waits for
the rest.

The S exchanges are one step: each is only begun on the thread (:meth:`SlimExchange.begin`,
nothing committed), and the step is settled on the caller's thread when all are back. Every
rank sees the same verdicts in the same order, so all commit together, or all drop the step (a
NaN/Inf under ``"flag"``/``"skip"``: a skipped stage ends the step, and the stages before it
are dropped exactly, so nothing of the exchange changes), or all raise (``"raise"``: nothing
changes; any other failure: every stage keeps this rank's gradient in its residual, or a
host-first stage never reduced in its carry, as a flat exchange does). The pulled values are
written into ``p.grad`` only then, on the caller's thread.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ...config import SlimConfig
from ...transport.base import Transport
from .. import checkpoint, handshake, outcome
from ..describe import stages_text
from ..errors import NonFiniteGradientError
from ..layout import Layout
from ..protocol import Stage
from ..step import Pending, SlimExchange
from .order import Deferred, OrderedJob, late_verdict
from .runner import Job, ends_step, runner_for
from .stats import StagedStats

Opener = Optional[Callable[[], Optional[Callable[[], Any]]]]


def stage_cuts(named: Sequence[Tuple[str, torch.Tensor]], stages: int
               ) -> List[List[Tuple[str, torch.Tensor]]]:
    """``named`` (in ``named_parameters`` order) reversed and cut into at most ``stages``
    contiguous runs of about equal numel; a parameter is never split, so there are at most as
    many stages as parameters."""
    order = list(reversed(named))
    n = max(1, min(stages, len(order)))
    total = sum(p.numel() for _, p in order)
    cuts: List[List[Tuple[str, torch.Tensor]]] = []
    current: List[Tuple[str, torch.Tensor]] = []
    acc = 0
    for i, (name, p) in enumerate(order):
        current.append((name, p))
        acc += p.numel()
        closed, left = len(cuts), len(order) - i - 1
        if closed < n - 1 and (acc * n >= (closed + 1) * total or left == n - 1 - closed):
            cuts.append(current)
            current = []
    if current:
        cuts.append(current)
    return cuts


IN_FLIGHT = ("hvd_slim: a step's exchange is in flight (loss.backward() ran since the last "
             "step()): call step() or synchronize() before {what}")


class StagedExchange:
    """Per-rank state of ``overlap=S``: one exchange per stage (flat or host-first), and the
    step they make together. Offers what the optimizer uses of :class:`SlimExchange`, and
    :meth:`grad_ready` for the gradient hook."""

    def __init__(self, layout: Layout, config: SlimConfig, transport: Transport,
                 momentum: Optional[Dict[int, dict]], ranks: Optional[Sequence[int]],
                 order: Sequence[str], threaded: bool,
                 make_stage: Optional[Callable[[Layout, Dict[int, dict]], Any]] = None
                 ) -> None:
        """``make_stage(layout, momentum)``: each stage's exchange (``hierarchical=True``'s);
        None: a :class:`SlimExchange` over ``transport``."""
        by_name = {s.name: s.param for b in layout.buckets for s in b.segments}
        named = [(n, by_name[n]) for n in order if n in by_name]
        comm_dtype = {b.dtype: b.comm_dtype for b in layout.buckets}
        bucket_of = {id(s.param): b.index for b in layout.sparse for s in b.segments}
        self.layout, self.transport = layout, transport
        self.cuts = stage_cuts(named, config.overlap)
        self.stages: List[Stage] = []
        momentum = momentum or {}
        for cut in self.cuts:
            sl = Layout(cut, config, lambda dt: comm_dtype[dt],
                        loss_scale=layout.loss_scale)
            # A stage's compressed bucket takes the momentum plan of the whole model's bucket
            # its parameters come from (one per dtype).
            whole = {sb.index: bucket_of[id(sb.segments[0].param)] for sb in sl.sparse}
            plan = {i: momentum[w] for i, w in whole.items() if w in momentum}
            self.stages.append(make_stage(sl, plan) if make_stage is not None else
                               SlimExchange(sl, config, transport, plan, ranks=ranks))
        first = self.stages[0]
        self.cfg = first.cfg   # a process set's: server_rank in its numbering
        self.rank, self.size, self.ranks, self.in_set = first.rank, first.size, first.ranks, \
            first.in_set
        self.servers = max(st.servers for st in self.stages)
        self.digest = layout.digest() ^ int(self.cfg.digest(), 16)
        self.stats = StagedStats(layout, self.size, self.stages)
        self.stage_of = {id(p): k for k, cut in enumerate(self.cuts) for _, p in cut}
        self._sizes = [len(cut) for cut in self.cuts]   # parameters per stage
        self._waiting = list(self._sizes)
        self._runner = runner_for(transport, threaded)
        self._job: Optional[Job] = None
        self.agreement = handshake.Agreement()
        self._late_verdict = late_verdict(layout, config, host_sums=make_stage is not None)

    @property
    def step_count(self) -> int:
        return self.stages[0].step_count

    # --- the step ----------------------------------------------------------------------------
    def grad_ready(self, p: torch.Tensor, opener: Opener) -> None:
        """From the gradient hook: ``p``'s last gradient of this step is in. The first time in
        a step, queue the step (after ``opener()``'s round); a stage whose parameters are all in
        may start."""
        k = self.stage_of.get(id(p))
        if k is None or not self._runner.threaded:
            return
        if self._job is None:
            self._start(opener)
        self._waiting[k] -= 1
        if self._waiting[k] == 0:
            self._runner.ready(self._job, k)

    def step(self, opener: Opener = None, defer: bool = False) -> Union[bool, Deferred]:
        """:meth:`SlimExchange.step` for every stage: the stages not begun yet run now. With
        ``defer`` (``overlap_forward``, on a communication thread), once every rank's gradients
        are in and none has a NaN/Inf, return a :class:`Deferred` instead of waiting for the
        rest (exchange/overlap/order.py)."""
        if self._job is None:
            self._start(opener)
        job, self._job = self._job, None
        self._waiting = list(self._sizes)
        if defer and isinstance(job, OrderedJob) and self._runner.threaded \
                and not self._late_verdict:
            self._runner.release(job)
            job.verdict.wait()
            if job.clear and job.error is None:
                return Deferred(self, job)
        self._runner.wait(job)
        return self._settle(job)

    def _start(self, opener: Opener) -> None:
        t = self.step_count
        waiter = opener() if opener is not None else None

        def first() -> None:
            if waiter is not None:
                waiter()   # a refusal here leaves everything as it was
            self._rounded = True
            self._handshake(t)   # a failure here keeps the gradients in the residuals

        self._rounded = False
        if self.cfg.overlap_forward:
            self._job = OrderedJob(self.stages, first, t, self.digest)
        else:
            self._job = Job([st.begin for st in self.stages], first)
        self._runner.submit(self._job)

    def _settle(self, job: Job) -> bool:
        """On the caller's thread, with every stage back: commit all, drop all, or raise."""
        begun: Dict[int, Pending] = job.outcomes
        prepared = job.prepared   # local phases run, exchange not begun
        if job.error is not None:
            failed, exc = job.error
            if isinstance(exc, NonFiniteGradientError) or not self._rounded:
                self._drop(begun, prepared)   # nothing changes
            else:
                self.keep(range(len(self.stages)), begun, prepared, failed)
            raise exc
        skipped = [k for k, out in begun.items() if ends_step(out)]
        if skipped:   # a stage every rank skipped
            self._drop(begun, prepared)
            self.stats.last_skip = self.stages[skipped[0]].stats.last_skip
            return outcome.skipped(self.stats, self.cfg.nonfinite, self.flag_grads)
        for k in sorted(begun):
            self.stages[k].settle(begun[k], commit=True)
        return True

    def _drop(self, begun: Dict[int, Pending], prepared: Dict[int, Any]) -> None:
        """Every stage of the step dropped exactly (selectors as they were)."""
        for k, pending in begun.items():
            self.stages[k].drop(pending)
        for k, prep in prepared.items():
            self.stages[k].drop(prep)

    def drop(self, which: Sequence[int], job: Job) -> None:
        """:meth:`_drop` for the stages ``which`` of ``job`` only."""
        self._drop({k: v for k, v in job.outcomes.items() if k in which},
                   {k: v for k, v in job.prepared.items() if k in which})

    def keep(self, which: Sequence[int], begun: Dict[int, Pending], prepared: Dict[int, Any],
             failed: int) -> None:
        """A failed step: keep this rank's gradient of each stage in ``which`` in its
        residual, whether begun, only prepared, or never reached (the failed stage did so
        itself)."""
        for k in which:
            st = self.stages[k]
            if k in begun:
                st.absorb(begun[k])
            elif k in prepared:
                st.absorb(prepared[k])
            elif k != failed:
                st.absorb(None)

    def flag_grads(self) -> None:
        """A step every rank skipped under ``nonfinite="flag"``: every stage's gradients NaN."""
        for st in self.stages:
            st.flag_grads()

    def flush(self) -> None:
        """:meth:`SlimExchange.flush`, stage by stage (on the communication thread, in turn)."""
        t = self.step_count

        def first() -> None:
            self._handshake(t)

        job = Job([_flush_stage(st) for st in self.stages], first)
        self._runner.submit(job)
        self._runner.wait(job)
        if job.error is not None:
            raise job.error[1]

    def _handshake(self, t: int) -> None:
        """Once (and after a load), before the first stage: every rank agrees on the whole
        model and settings (the same collective as a flat exchange's, so a rank with another
        ``overlap`` is named)."""
        self.agreement.ensure(self, t, self.stages[0].collective)
        for st in self.stages:   # it covers every stage: none runs a handshake of its own
            st.agreement.mark()

    # --- state -------------------------------------------------------------------------------
    def held_residuals(self) -> Dict[int, torch.Tensor]:
        """:meth:`SlimExchange.held_residuals` in the whole model's buckets."""
        out = {b.index: torch.zeros(b.numel, dtype=torch.float64) for b in self.layout.sparse}
        place = {s.name: (b.index, s.offset) for b in self.layout.sparse for s in b.segments}
        for st in self.stages:
            held = st.held_residuals()
            for b in st.layout.sparse:
                for s in b.segments:
                    i, off = place[s.name]
                    out[i][off:off + s.numel] = held[b.index][s.offset:s.offset + s.numel].cpu()
        return out

    def residual_norm(self) -> float:
        return sum(st.residual_norm() for st in self.stages)

    def state_dict(self) -> dict:
        """Every stage's state, and how the model was cut. Refused while a step's exchange is
        in flight: its stages' selectors are mid-step on the communication thread."""
        if self._job is not None:
            raise ValueError(IN_FLIGHT.format(what="state_dict()"))
        return {"version": checkpoint.VERSION, "rank": self.rank, "size": self.size,
                "effective": self.cfg.effective_dict(),
                "overlap": {"stages": [[n for n, _ in cut] for cut in self.cuts]},
                "stages": [st.state_dict() for st in self.stages],
                "skipped_steps": self.stats.skipped_steps}

    def validate_state_dict(self, state: dict) -> None:
        if self._job is not None:
            raise ValueError(IN_FLIGHT.format(what="load_state_dict()"))
        cuts = [[n for n, _ in cut] for cut in self.cuts]
        if not isinstance(state, dict) or "overlap" not in state:
            saved = (state.get("effective") or {}).get("overlap", 1) \
                if isinstance(state, dict) else 1
            raise ValueError(f"hvd_slim checkpoint was made with overlap={saved} (one exchange "
                             f"per step); this optimizer has overlap={self.cfg.overlap}: resume "
                             "with the overlap it was saved with, or call optimizer.flush() "
                             "before saving and load without the 'hvd_slim' entry")
        if state["overlap"] != {"stages": cuts}:
            got = state["overlap"].get("stages") if isinstance(state["overlap"], dict) else None
            raise ValueError(f"hvd_slim checkpoint cuts the model into "
                             f"{len(got) if isinstance(got, list) else got!r} stages "
                             f"{stages_text(got)}; this optimizer into {len(cuts)} "
                             f"{stages_text(cuts)}. Resume with the same overlap and model")
        if state.get("rank") != self.rank or state.get("size") != self.size:
            raise ValueError(f"hvd_slim checkpoint holds rank {state.get('rank')} of "
                             f"{state.get('size')}; this is rank {self.rank} of {self.size}. "
                             f"{checkpoint.FIX_RANK}")
        if not isinstance(state.get("stages"), list) or len(state["stages"]) != len(cuts):
            raise ValueError("hvd_slim checkpoint: 'stages' must hold one state per stage")
        for st, saved in zip(self.stages, state["stages"]):
            st.validate_state_dict(saved)

    def load_state_dict(self, state: dict) -> None:
        self.validate_state_dict(state)
        for st, saved in zip(self.stages, state["stages"]):
            st.load_state_dict(saved)
        self.stats.skipped_steps = int(state.get("skipped_steps", 0))
        self.agreement.reset()


def _flush_stage(st: Stage) -> Callable[[], Any]:
    def run() -> Any:
        st.flush()
        return True
    return run

