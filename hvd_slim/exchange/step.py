"""One Slim-DP step as a fixed sequence of phases (docs/design.md §2), for one rank.

    compensate -> select -> push -> aggregate (server) -> pull -> apply

:meth:`SlimExchange.step` is the only place that fixes this order. It reads each parameter's
``.grad`` and writes the pulled update back into it; the wrapped optimizer's ``step()`` runs
afterwards. Nothing here knows about MPI: the transport is passed in.

Compensation is speculative: this rank's residual, velocity and cores change only when the
pull says the step went through. A step can also end in a verdict every rank shares: SKIP (a
NaN/Inf gradient under ``nonfinite="skip"``: nothing changes anywhere) or an ERROR every rank
raises (a NaN/Inf under ``"raise"``: nothing changes; any other failure: each worker keeps what
it computed in its residual, so nothing is lost).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional

import torch

from ..config import SlimConfig
from ..memory import ResidualMemory
from ..selection import ROLE_PULL, CoreSelector, slice_indices
from ..transport.base import Transport, TransportTimeout
from ..wire import control
from ..wire import message as wm
from . import checkpoint, handshake
from .expect import message_bound, pull_expect, push_expect
from .errors import TIMEOUT_ADVICE, ExchangeError, NonFiniteGradientError
from .layout import DENSE, Bucket, Layout
from .sections import indices_on, itemsizes, section_values
from .server import Server, decode_pull
from .stats import ExchangeStats
from .wirepath import WirePath, wire_path
from .worker import Proposal, WorkerSide

__all__ = ["ExchangeError", "NonFiniteGradientError", "SlimExchange"]


class SlimExchange(WorkerSide):
    """Per-rank Slim-DP state (residuals, cached cores, server state) and the step sequence."""

    def __init__(self, layout: Layout, config: SlimConfig, transport: Transport,
                 momentum: Optional[Dict[int, dict]] = None) -> None:
        config.check_world(transport.size)
        self.layout, self.cfg, self.transport = layout, config, transport
        self.rank, self.size = transport.rank, transport.size
        self.digest = layout.digest() ^ int(config.digest(), 16)
        self.step_count = 0
        momentum = momentum or {}
        self.memory = {b.index: ResidualMemory(b.numel, b.dtype, b.device,
                                               **momentum.get(b.index, {}))
                       for b in layout.sparse}
        self.selector = {b.index: CoreSelector() for b in layout.sparse}
        self.core: Dict[int, torch.Tensor] = {}        # this worker's cached push cores
        self.pull_core: Dict[int, torch.Tensor] = {}   # the server's cached pull cores
        # Host numpy or device tensors for the messages: whichever the transport takes for the
        # parameters' device (the layout refuses parameters on more than one device).
        device = layout.buckets[0].device if layout.buckets else torch.device("cpu")
        self.path: WirePath = wire_path(transport, device)
        self.server = Server(layout, config, self.size, self.rank, self.path) \
            if self.rank == config.server_rank else None
        self._flat = {b.index: torch.zeros(b.numel, dtype=b.dtype, device=b.device)
                      for b in layout.buckets}
        self._score: Dict[int, torch.Tensor] = {}   # only with magnitude_weight > 0
        self._pulled: Dict[int, torch.Tensor] = {}  # sliced pulls; each p.grad views it
        self._pending: List[Proposal] = []
        self._agreed = False   # the handshake has not run yet
        self.stats = ExchangeStats(layout, self.size)

    # --- the step ----------------------------------------------------------------------------
    def step(self) -> bool:
        """Exchange the current gradients; afterwards every ``p.grad`` holds the pulled update.
        Returns False when every rank skipped the step (a NaN/Inf gradient somewhere under
        ``nonfinite="skip"``): then nothing changed and ``p.grad`` is as the caller left it."""
        t, t0 = self.step_count, time.perf_counter()
        self._pending = []
        selectors = {i: s.state_dict() for i, s in self.selector.items()}
        try:
            sections, report = self._compensate_and_select_all(t)
            self._agree(t)
            pushed = self._push(sections, report, t)
            pulled = self._aggregate_and_pull(pushed, t, flush=False)
        except NonFiniteGradientError:
            self._rollback(selectors)
            raise
        except BaseException:
            self._absorb()
            raise
        if pulled is None:
            self._rollback(selectors)
            self.stats.skipped_steps += 1
            return False
        self._apply(pulled, t)
        self.step_count += 1
        self.stats.finish_step(time.perf_counter() - t0)
        return True

    def flush(self) -> None:
        """Send every residual (workers' and server's) densely; compressed ``p.grad`` then hold
        it and dense-bucket grads are untouched. Call the inner optimizer's step afterwards."""
        t = self.step_count
        self._pending = []
        sections = []
        for b in self.layout.buckets:
            if b.kind == DENSE:
                sections.append(self.path.empty())
                continue
            wire = self.memory[b.index].residual.to(b.wire_dtype, copy=True)
            self._pending.append(Proposal(b.index, None, wire.to(b.dtype)
                                           if b.wire_dtype != b.dtype else None, False))
            sections.append(self.path.section(wm.M_DENSE, wire, b.numel))
        try:
            self._agree(t)
            pushed = self._push(sections, None, t, flush=True)
            pulled = self._aggregate_and_pull(pushed, t, flush=True)
        except BaseException:
            self._pending = []   # nothing was forgotten: every residual is still in place
            raise
        self._apply(pulled, t)
        self.stats.flushes += 1

    # --- phases ------------------------------------------------------------------------------
    def _agree(self, t: int) -> None:
        """The handshake, once per exchange (and again after loading a checkpoint)."""
        if not self._agreed:
            self._collective(lambda: handshake.agree(self, t), f"the handshake of step {t}")
            self._agreed = True

    def _push(self, sections: List[wm.Section], report: Optional[str], t: int,
              flush: bool = False) -> Optional[List[Any]]:
        kind = wm.FLUSH_PUSH if flush else wm.PUSH
        bound = message_bound(push_expect(self.layout.at_step(t), t, self.cfg.refresh_interval,
                                          flush=flush))
        if report is None:
            buf, sizes = self.path.encode(kind, self.rank, t, self.digest, sections,
                                          itemsizes(self.layout.at_step(t), sections))
            self.stats.record_push(sections, sizes)
        else:   # a NaN/Inf: report it instead of pushing; the server decides for every rank
            buf = self.path.from_host(control.encode_text(wm.NONFINITE, self.rank, t,
                                                          self.digest, report, limit=bound))
        before = self.transport.stats.bytes_sent
        gathered = self._collective(lambda: self.path.gather(
            self.transport, buf, self.cfg.server_rank, bound), f"the push of step {t}")
        sent = self.transport.stats.bytes_sent - before
        self.stats.bytes_pushed += sent
        self.stats.last["bytes_pushed"] = sent
        return gathered

    def _collective(self, fn: Callable[[], Any], what: str) -> Any:
        """Run collectives under the exchange timeout; a timeout error says what to do."""
        try:
            with self.transport.watch(self.cfg.timeout, what):
                return fn()
        except TransportTimeout as exc:
            raise TransportTimeout(f"{exc}. {TIMEOUT_ADVICE} (now {self.cfg.timeout:g} s)"
                                   ) from None

    def _aggregate_and_pull(self, gathered: Optional[List[Any]], t: int,
                            flush: bool) -> Optional[List[wm.Section]]:
        """The pulled sections, or None for a step every rank skips."""
        bound = message_bound(pull_expect(self.layout.at_step(t), t, self.cfg.refresh_interval,
                                          self.cfg.pull, flush, size=self.size))
        reply = None
        if self.server is not None:
            try:
                reply = self.server.serve(gathered, t, self.digest, flush, limit=bound)
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it, then raise
                reply = self.path.from_host(wm.encode_error(
                    self.rank, t, f"server rank {self.rank} failed at step {t}: "
                    f"{type(exc).__name__}: {exc}", limit=bound))
        before = self.transport.stats.bytes_received
        buf = self._collective(lambda: self.path.broadcast(
            self.transport, reply, self.cfg.server_rank, bound), f"the pull of step {t}")
        received = self.transport.stats.bytes_received - before
        self.stats.bytes_pulled += received
        self.stats.last["bytes_pulled"] = received
        who = "pull from the server"
        try:
            if not flush and self.path.peek(buf, who) == wm.SKIP:
                self.stats.last_skip = control.decode_text(
                    self.path.host(buf), kind=wm.SKIP, sender=self.cfg.server_rank, step=t,
                    digest=self.digest, who=who)
                return None
            sections = decode_pull(self.layout, self.cfg, buf, t, self.digest, flush, self.path,
                                   self.size)
        except wm.RemoteError as exc:
            if exc.code == wm.E_NONFINITE:
                raise NonFiniteGradientError(str(exc)) from None
            raise ExchangeError(str(exc)) from None
        except wm.WireError as exc:
            raise ExchangeError(f"rank {self.rank}: {exc}") from None
        self.stats.record_pull(buf, sections)
        return sections

    def _apply(self, sections: List[wm.Section], t: int) -> None:
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

    # --- checkpoint --------------------------------------------------------------------------
    def residual_norm(self) -> float:
        """Sum of squares of every residual this rank holds (worker and server)."""
        total = sum(float(m.residual.double().pow(2).sum()) for m in self.memory.values())
        if self.server is not None:
            total += sum(float(m.residual.double().pow(2).sum())
                         for m in self.server.memory.values())
        return total

    def state_dict(self) -> dict:
        """This rank's residuals, velocities, cores, step and stats (and the server's state on
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
        self._pending = []
        self._agreed = False
