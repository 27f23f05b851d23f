"""One Slim-DP step as a fixed sequence of phases (docs/design.md §2), for one rank.

    compensate -> select -> push -> aggregate (server) -> pull -> apply

with the handshake once, before the first push (and again after a checkpoint is loaded).
:meth:`SlimExchange.step` fixes this order for the flat exchange (the hosts-first and
staged exchanges, exchange/hosts/hierarchy.py and exchange/overlap/staged.py, order theirs around
it): one call a phase, the worker's (:class:`~hvd_slim.exchange.worker.Worker`) and the server's
(:class:`~hvd_slim.exchange.server.Server`) halves on their own objects, the collective phases
in step_wire.py.
It reads each parameter's ``.grad`` and writes the pulled update back into it; the wrapped
optimizer's ``step()`` runs afterwards. Nothing here knows about MPI: the transport is passed in.

Compensation is speculative: this rank's residual, velocity and selectors change only when the
pull says the step went through. A step can also end in a verdict every rank shares: SKIP (a
NaN/Inf gradient under ``nonfinite="flag"`` or ``"skip"``: nothing of the exchange changes
anywhere; ``"flag"`` then sets every gradient to NaN on every rank) or an ERROR every rank
raises (a NaN/Inf under ``"raise"``: nothing changes; any other failure: each worker keeps what
it computed in its residual, so nothing is lost).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch

from ..config import SlimConfig
from ..transport.base import Transport
from ..wire import message as wm
from . import checkpoint, handshake, outcome, step_wire
from .errors import ExchangeError, NonFiniteGradientError
from .layout import Layout
from .overlap.runner import exclusive
from .server import Server
from .shards import ShardPlan, ShardView
from .stats import ExchangeStats
from .timeout import watched
from .wirepath import WirePath, wire_path
from .worker import Worker

__all__ = ["ExchangeError", "NonFiniteGradientError", "Pending", "Prepared", "SlimExchange"]


@dataclass
class Pending:
    """A step :meth:`SlimExchange.begin` has exchanged but not settled: its step, start time,
    the selectors' state before it, and the pull (None: every rank skips it)."""

    t: int
    t0: float
    selectors: Dict[int, dict]
    pulled: Optional[List[List[wm.Section]]]
    rendered: Any = None   # Puller.render of the pull, when a caller needed it before settle


@dataclass
class Prepared:
    """What :meth:`SlimExchange.prepare` computed for step ``t``: the selected sections per
    shard (or the NaN/Inf ``report`` to push instead), and the selectors' state before it."""

    t: int
    t0: float
    selectors: Dict[int, dict]
    sections: List[List[wm.Section]]
    report: Optional[str]


class SlimExchange:
    """Per-rank Slim-DP state (the worker, and the server on ``server_rank``) and the step
    sequence."""

    def __init__(self, layout: Layout, config: SlimConfig, transport: Transport,
                 momentum: Optional[Dict[int, dict]] = None,
                 ranks: Optional[Sequence[int]] = None) -> None:
        # ranks: the job ranks of the transport's members, in its order (a process set); None:
        # every rank of the job, numbered as the transport numbers them. Everything below runs
        # in the transport's numbering, so a set's server_rank (a job rank) is translated.
        if ranks is None:
            config.check_world(transport.size)
        elif len(ranks) != transport.size:
            raise ValueError(f"the process set has {len(ranks)} ranks but its exchange "
                             f"transport {transport.size}")
        else:
            config = config.for_ranks(ranks)
        self.ranks = list(range(transport.size)) if ranks is None else list(ranks)
        self.in_set = ranks is not None
        self.layout, self.cfg, self.transport = layout, config, transport
        self.rank, self.size = transport.rank, transport.size
        self.digest = layout.digest() ^ int(config.digest(), 16)
        self.step_count = 0
        self.stats = ExchangeStats(layout, self.size)
        # Host numpy or device tensors for the messages: whichever the transport takes for the
        # parameters' device (the layout refuses parameters on more than one device).
        device = layout.buckets[0].device if layout.buckets else torch.device("cpu")
        self.path: WirePath = wire_path(transport, device)
        # servers=S: shard s of every bucket is aggregated by rank roots[s] (shards.py).
        self.servers = config.servers_for(self.size, sum(b.numel for b in layout.sparse))
        self.shards = ShardPlan(layout, self.servers, self.size, config.server_rank)
        self.roots = self.shards.roots
        self.worker = Worker(layout, config, self.rank, self.size, self.digest, self.path,
                             self.stats, momentum, self.shards)
        self.shard = self.roots.index(self.rank) if self.rank in self.roots else None
        self.server = None
        if self.shard is not None:
            view = layout if self.servers == 1 else ShardView(self.shards, self.shard)
            self.server = Server(view, config, self.size, self.rank, self.path)
        self.agreement = handshake.Agreement()   # the handshake has not run yet

    # --- the step ----------------------------------------------------------------------------
    def step(self) -> bool:
        """Exchange the current gradients; afterwards every ``p.grad`` holds the pulled update.
        Returns False when every rank skipped the step (a NaN/Inf gradient somewhere under
        ``nonfinite="flag"`` or ``"skip"``): then nothing of the exchange changed, and ``p.grad``
        is NaN on every rank (``"flag"``) or as the caller left it (``"skip"``)."""
        with exclusive(self.transport):   # after any overlapped step queued on the transport
            pending = self.begin()
        return outcome.finish(self, pending)

    def begin(self) -> "Pending":
        """Every phase of a step but its outcome: compensate, select, push, aggregate and pull.
        Nothing of the exchange is committed yet (the worker's proposals and the server's plan
        wait for :meth:`settle`), so a caller running several exchanges as one step
        (exchange/overlap/staged.py) commits all or none. A skip (``pulled`` None) is settled by the
        caller too; an error is settled here (a NaN/Inf under ``"raise"``: nothing changes;
        any other failure: this rank's gradient is kept in its residual) and raised."""
        return self.communicate(self.prepare())

    def prepare(self) -> "Prepared":
        """The local phases of :meth:`begin` (compensate and select): what it reads of the
        gradients is read here, so :meth:`communicate` may run on another thread while the
        caller goes on with ``p.grad`` (``outer_delay``)."""
        t, t0 = self.step_count, time.perf_counter()
        worker = self.worker
        selectors = worker.selector_states()
        try:
            compensated = worker.compensate(t)
            sections, report = worker.select(t, compensated)
        except BaseException:
            worker.absorb()
            raise
        self.stats.timed("prepare", t0)
        return Prepared(t, t0, selectors, sections, report)

    def communicate(self, prep: "Prepared") -> "Pending":
        """The collective phases of :meth:`begin` on what :meth:`prepare` selected: handshake,
        push, aggregate and pull."""
        t = prep.t
        self.stats.last = {}
        before = step_wire.traffic(self)
        try:
            # The first collective comes after the local phases, so a failed handshake keeps
            # this step's gradient in the residual (absorb) like any other failure.
            self.agreement.ensure(self, t, self.collective)
            pushed = step_wire.push(self, prep.sections, prep.report, t)
            reply = step_wire.aggregate(self, pushed, t)
            pulled = step_wire.pull(self, reply, t, defer=True)
        except NonFiniteGradientError:
            self.worker.rollback(prep.selectors)
            raise
        except BaseException:
            self.worker.absorb()
            raise
        finally:
            step_wire.count_traffic(self, before)
        return Pending(t, prep.t0, prep.selectors, pulled)

    def settle(self, pending: "Pending", commit: bool) -> None:
        """The outcome of :meth:`begin`: ``commit`` a pulled step (the server's plan and this
        rank's proposals, the pulled values into ``p.grad``), else drop it exactly (every rank
        skips it: nothing of the exchange changes)."""
        ok = commit and pending.pulled is not None
        if self.server is not None:
            self.server.settle(ok)
        if not ok:
            self.worker.rollback(pending.selectors)
            return
        start = time.perf_counter()
        self.worker.apply(pending.pulled, pending.t, pending.rendered)
        schedule = self.layout.schedule
        if schedule.observing(pending.t):   # the warm-up's signal: what this step delivered
            # in true units (a loss scale told: the pull went back at it; exact, a power of two)
            schedule.observe(pending.t, self.layout.delivered_norm() / self.worker.scale)
        self.stats.timed("apply", start)
        self.step_count += 1
        self.stats.finish_step(time.perf_counter() - pending.t0)

    def drop(self, what: Union["Pending", "Prepared"]) -> None:
        """Every rank drops the step (another exchange of it skipped), begun or only prepared:
        nothing of the exchange changes."""
        if isinstance(what, Pending):
            self.settle(what, commit=False)
        else:
            self.worker.rollback(what.selectors)

    def absorb(self, what: Union["Pending", "Prepared", None]) -> None:
        """A step that another exchange of the same step failed: keep what this one computed
        in the residual (the server's plan undone), as a failure of this one would. ``what``:
        its :meth:`begin`, its :meth:`prepare` only, or None (never begun: compute this rank's
        proposals first)."""
        if what is None:
            t = self.step_count
            compensated = self.worker.compensate(t)
            self.worker.select(t, compensated)
        elif isinstance(what, Pending) and self.server is not None:
            self.server.settle(False)
        self.worker.absorb()

    def flag_grads(self) -> None:
        """A step every rank skipped under ``nonfinite="flag"``: every gradient NaN."""
        self.worker.flag_grads()

    def flush(self) -> None:
        """Send every residual (workers' and server's) densely; compressed ``p.grad`` then hold
        it and dense-bucket grads are untouched. Call the inner optimizer's step afterwards."""
        with exclusive(self.transport):
            self._flush()

    def _flush(self) -> None:
        t = self.step_count
        sections = self.worker.flush_sections()
        self.stats.last = {}
        before = step_wire.traffic(self)
        try:
            self.agreement.ensure(self, t, self.collective)
            pushed = step_wire.push(self, sections, None, t, flush=True)
            reply = step_wire.aggregate(self, pushed, t, flush=True)
            pulled = step_wire.pull(self, reply, t, flush=True)
        except BaseException:
            self.worker.drop_pending()   # nothing was forgotten: every residual is in place
            raise
        finally:
            step_wire.count_traffic(self, before)
        self.worker.apply(pulled, t)
        self.stats.flushes += 1

    def agree(self) -> None:
        """Run the handshake now unless it has run (``local_steps``: at the first local step,
        so a rank with other settings is named before a round's work is done). Collective."""
        if not self.agreement.done:
            with exclusive(self.transport):
                self.agreement.ensure(self, self.step_count, self.collective)

    # --- collectives -------------------------------------------------------------------------
    def collective(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()``'s collectives over this exchange's transport, under the exchange timeout
        (``what``: what a timeout error names)."""
        return watched(self.transport, self.cfg.timeout, fn, what)

    # --- checkpoint --------------------------------------------------------------------------
    def residual_norm(self) -> float:
        """Sum of squares of every residual this rank holds (worker and server)."""
        return checkpoint.residual_norm(self)

    def held_residuals(self) -> Dict[int, torch.Tensor]:
        """Per compressed bucket (by index), every residual this rank holds as one float64
        vector: its worker's plus, on a server, its shard's pieces of the server residual."""
        return checkpoint.held_residuals(self)

    def held_as_pushes(self) -> Dict[int, torch.Tensor]:
        """Per compressed bucket (by index), what this rank holds as one float64 vector in the
        units of its own pushes: its worker's residual plus, on a server, its shard's pieces of
        the server residual undone of the server's scale (N for an average). Added to this
        rank's next gradient in another exchange, every value still arrives exactly once."""
        return checkpoint.held_as_pushes(self)

    def state_dict(self) -> dict:
        """This rank's residuals, velocities, selectors, step and stats (and the server's state on
        the server rank): tensors and plain values only."""
        return checkpoint.state_of(self)

    def validate_state_dict(self, state: dict) -> None:
        """Raise ValueError, naming what differs, unless ``state`` loads here; changes nothing."""
        checkpoint.validate(self, state)

    def load_state_dict(self, state: dict) -> None:
        """Validate ``state`` completely, then load it (a refused state changes nothing). The
        next step repeats the handshake, so ranks resumed from different steps are caught."""
        checkpoint.validate(self, state)
        checkpoint.load(self, state)
        self.worker.drop_pending()
        self.agreement.reset()
