"""Node-local aggregation (``hierarchical=True``, docs/design.md §2 "Hosts"): the ranks of a
host combine their gradients over the local link, then the hosts run the Slim-DP exchange.

With H hosts of L ranks each, every bucket is cut into L contiguous pieces, and local rank l:

1. **reduces**: receives piece l of every local rank's gradient (one ``gather_many`` on the
   local transport, every local rank a root) and adds them in local-rank order (the host's mean
   under ``op="average"``);
2. **exchanges** its pieces with the l-th rank of every other host: a :class:`SlimExchange` on
   the cross transport (numbered by host), whose worker residual is the host's and whose server
   is local rank l of the server's host (so the L ranks of that host share the server's work);
3. **spreads**: sends its pulled pieces to the host (``broadcast_many``), so that every rank
   writes the whole update into its ``.grad``.

Every rank applies bitwise the same update: piece l's pull is the same on every host (the
cross exchange's identity), and every rank of a host assembles the same pieces. A NaN/Inf on
any rank of a host poisons all of the host's pieces (a flag travels with step 1), so every
cross exchange sees it and every rank skips or raises alike. Step 3 carries each piece's
verdict, so a rank whose pieces are all empty (tiny buckets) still follows it.

The step comes apart as :class:`SlimExchange`'s does (prepare, communicate, then settle, drop
or absorb), so each stage of ``overlap`` can be one (exchange/overlap/staged.py). A failure after
step 1 keeps the host's gradient in its residual pieces; one before, this rank's own in its
carry (exchange/hosts/phases.py, with the host collectives). The flush: exchange/hosts/flush.py; the
checkpoint (pieces, carry, step count): exchange/hosts/state.py; the host messages:
exchange/hosts/wire.py.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch

from ...config import ConfigError, SlimConfig
from ...runtime.hosts import host_table
from ...transport.base import Transport
from .. import handshake, outcome
from ..errors import NonFiniteGradientError
from ..finite import nonfinite_text
from ..layout import SPARSE, Layout
from ..overlap.runner import exclusive
from ..stats import ExchangeStats
from ..step import Pending, SlimExchange
from ..timeout import watched
from . import flush as host_flush
from . import state as host_state
from .phases import HostPending, HostPhases, HostPrepared
from .wire import FAILED, NONFINITE, OK, SKIPPED, cuts


class HierarchicalExchange:
    """Per-rank state of the hierarchical exchange: the local phases and this rank's cross
    exchange of its pieces. Offers what the optimizer uses of :class:`SlimExchange`."""

    def __init__(self, layout: Layout, config: SlimConfig, world: Transport, local: Transport,
                 cross: Transport, hosts: Sequence[int],
                 momentum: Optional[Dict[int, dict]] = None) -> None:
        """``hosts[r]``: the host number of world rank r; ``local`` numbers a host's ranks in
        rank order and ``cross`` the l-th ranks of all hosts by host number."""
        config.check_world(world.size)
        table = host_table(hosts)
        self.layout, self.cfg, self.transport = layout, config, world
        self.rank, self.size = world.rank, world.size
        self.local, self.cross = local, cross
        self.hosts, self.local_size = len(table), len(table[0])
        self.host = int(hosts[self.rank])
        self.local_rank = table[self.host].index(self.rank)
        if (local.size, local.rank, cross.size, cross.rank) != (
                self.local_size, self.local_rank, self.hosts, self.host):
            raise ValueError(f"rank {self.rank}: the local transport ({local.rank} of "
                             f"{local.size}) and cross transport ({cross.rank} of {cross.size}) "
                             f"do not match host {self.host} of {self.hosts} with "
                             f"{self.local_size} ranks each")
        self.digest = layout.digest() ^ int(config.digest(), 16)
        self.ranks, self.in_set = list(range(self.size)), False
        self.bounds = {b.index: cuts(b.numel, self.local_size) for b in layout.buckets}
        self.pieces, self.inner = self._build_inner(momentum or {}, hosts)
        self.servers = self.inner.servers if self.inner is not None else 1
        # The cross exchange's figures (bytes that crossed a NIC), measured against what a
        # dense allreduce of the whole model among every rank would move.
        self.stats = self.inner.stats if self.inner is not None else \
            ExchangeStats(layout, self.size)
        whole = ExchangeStats(layout, self.size)
        self.stats.grad_bytes, self.stats.ring_bytes = whole.grad_bytes, whole.ring_bytes
        self.stats.compressed_grad_bytes = whole.compressed_grad_bytes
        self.host_phases = HostPhases(layout, config, local, self.rank, self.host,
                                      table[self.host], self.stats)
        # Steps, when this rank has no pieces (and so no cross exchange to count them); in the
        # checkpoint, as a staged exchange's count can be its first stage's
        # (exchange/overlap/staged.py).
        self._steps = 0
        # The handshake runs among all ranks of the job, the same collective as a flat
        # exchange's, so a rank without ``hierarchical`` is named.
        self.agreement = handshake.Agreement()

    def _build_inner(self, momentum: Dict[int, dict], hosts: Sequence[int]) -> tuple:
        """This rank's pieces as stand-in parameters, and the cross exchange over them."""
        l, pieces, kinds = self.local_rank, {}, {}
        for b in self.layout.buckets:
            lo, hi = self.bounds[b.index][l:l + 2]
            if hi > lo:   # an empty piece (a bucket smaller than the host) takes no part
                name = f"bucket{b.index}.piece{l}[{b.segments[0].name}..{b.segments[-1].name}]"
                pieces[b.index] = (name, torch.nn.Parameter(torch.zeros(
                    hi - lo, dtype=b.dtype, device=b.device)))
                kinds[name] = b.kind
        if not pieces:
            return pieces, None
        inner_cfg = self.cfg.replaced(hierarchical=False,
                                      server_rank=int(hosts[self.cfg.server_rank]))
        comm_dtype = {b.dtype: b.comm_dtype for b in self.layout.buckets}
        inner_layout = Layout(list(pieces.values()), inner_cfg, lambda dt: comm_dtype[dt],
                              kinds=kinds, loss_scale=self.layout.loss_scale)
        name_of = {name: i for i, (name, _) in pieces.items()}
        plan = {ib.index: momentum[name_of[ib.segments[0].name]] for ib in inner_layout.buckets
                if name_of[ib.segments[0].name] in momentum and ib.kind == SPARSE}
        try:
            return pieces, SlimExchange(inner_layout, inner_cfg, self.cross, plan)
        except ConfigError as exc:
            if exc.field != "servers":
                raise
            raise ConfigError(f"{exc}; with hierarchical=True every host piece has its own "
                              f"servers, among the {self.hosts} hosts", "servers") from None

    @property
    def step_count(self) -> int:
        return self.inner.step_count if self.inner is not None else self._steps

    # --- the step ----------------------------------------------------------------------------
    def step(self) -> bool:
        """:meth:`SlimExchange.step` for the hierarchy: reduce on the host, exchange between the
        hosts, spread on the host."""
        # The host and cross transports are cached per world transport, so a staged
        # optimizer's communication thread may use them too: after its queued steps, alone.
        with exclusive(self.transport):
            pending = self.begin()
        return outcome.finish(self, pending)

    def begin(self) -> HostPending:
        """Every phase of a step but its outcome (:meth:`SlimExchange.begin`): reduce, the cross
        exchange begun, spread. Nothing of the exchange is committed until :meth:`settle`."""
        return self.communicate(self.prepare())

    def prepare(self) -> HostPrepared:
        """The local phase: this rank's gradient copied into its host reduction's messages
        (so ``p.grad`` may change afterwards), and whether it holds a NaN/Inf (which
        ``overlap_forward`` asks before its schedule round)."""
        t0 = time.perf_counter()
        try:
            payloads, bad = self.host_phases.encode()
            report = None
            if bad:
                names = [s.name for b in self.layout.buckets for s in b.segments if s.param.grad
                         is not None and not bool(torch.isfinite(s.param.grad).all())]
                report = nonfinite_text(names or ["a carried gradient"], False)
        except BaseException:   # the stage that failed keeps its own gradient, as SlimExchange's
            self.host_phases.keep_own(None)
            raise
        return HostPrepared(self.step_count, report, payloads, t0)

    def communicate(self, prep: HostPrepared) -> HostPending:
        """The collective phases of :meth:`begin`. A failure before the host took this rank's
        gradient in keeps it in the carry; one after, in the host's residual pieces."""
        t, host = prep.t, self.host_phases
        try:
            self.agreement.ensure(self, t, self.collective)
            host.reduce(t, self.pieces, prep.payloads)
        except BaseException:
            host.keep_own(prep.payloads)
            raise
        status, error, values, inner = self._begin_inner()
        try:
            pulled = host.spread(t, status, error, values)
        except BaseException as exc:
            # Which pieces keep the host's gradient (the carry with it) follows the verdicts
            # every rank of the host read alike; only when none was read, this rank's error.
            absorbed = host.absorbed()
            if absorbed is None:
                kept = not isinstance(exc, NonFiniteGradientError)   # else nothing changes
                absorbed = [kept] * host.size
            if inner is not None and status in (OK, SKIPPED):   # a host-mate's verdict
                if status == OK and absorbed[self.local_rank]:
                    self.inner.absorb(inner)
                else:
                    self.inner.settle(inner, commit=False)
            if any(absorbed):
                host.taken(absorbed)
            raise
        return HostPending(t, inner, pulled, prep.t0)

    def settle(self, pending: HostPending, commit: bool) -> None:
        """The outcome of :meth:`begin`: ``commit`` (the cross exchange, and the host's pieces
        into every ``p.grad``), else drop it exactly."""
        ok = commit and pending.pulled is not None
        if pending.inner is not None:
            self.inner.settle(pending.inner, ok)
        if ok:
            if self.inner is None:   # counted as a cross exchange counts, so every rank agrees
                self._steps += 1
                self.stats.finish_step(time.perf_counter() - pending.t0)
            self.host_phases.taken()
            self.host_phases.write(pending.pulled, only_sparse=False)

    def drop(self, what: Union[HostPending, HostPrepared]) -> None:
        """:meth:`SlimExchange.drop`."""
        if isinstance(what, HostPending):
            self.settle(what, commit=False)

    def absorb(self, what: Union[HostPending, HostPrepared, None]) -> None:
        """:meth:`SlimExchange.absorb`: a step begun keeps the host's gradient in its residual
        pieces; one the host never reduced keeps this rank's own gradient in its carry."""
        if isinstance(what, HostPending):
            if what.inner is not None:
                self.inner.absorb(what.inner)
            # Every local rank absorbs the same stage, so the host's residual pieces hold
            # every carry, this rank's too (also when it holds no piece of its own).
            self.host_phases.taken()
        else:   # only prepared: what it read; never begun: the gradient as it is
            self.host_phases.keep_own(what.payloads if what is not None else None)

    def flag_grads(self) -> None:
        """A step every rank skipped under ``nonfinite="flag"``: every gradient NaN."""
        self.host_phases.flag_grads()

    def flush(self) -> None:
        """:meth:`SlimExchange.flush`: every residual of every host, and every rank's carry,
        sent densely into the compressed ``p.grad``; dense-bucket grads are untouched."""
        with exclusive(self.transport):   # as in step(); a no-op on the runner's own thread
            host_flush.flush(self)

    def collective(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()``'s collectives of the whole job under the exchange timeout (the handshake,
        an overlapped step's schedule rounds: exchange/overlap/staged.py)."""
        return watched(self.transport, self.cfg.timeout, fn, what)

    def _begin_inner(self) -> Tuple[int, Optional[BaseException], list, Optional[Pending]]:
        """Step 2 begun: its verdict and error for the spread, this rank's pulled pieces, and
        the cross exchange's pending step (None after a failure, which the cross exchange
        settled itself, or without pieces)."""
        if self.inner is None:
            return OK, None, [], None
        try:
            pending = self.inner.begin()
        except NonFiniteGradientError as exc:
            return NONFINITE, exc, [], None
        except Exception as exc:  # noqa: BLE001 - the host must learn of it, then it is raised
            return FAILED, exc, [], None
        if pending.pulled is None:
            return SKIPPED, None, [], pending
        # The values the pull delivers, before the commit (the render is kept for it).
        pending.rendered = self.inner.worker.render(pending.pulled, pending.t)
        values = pending.rendered
        by_name: Dict[str, torch.Tensor] = {}
        for ib in self.inner.layout.buckets:
            got = values.get(ib.index)
            for seg in ib.segments:
                by_name[seg.name] = got[0][seg.offset:seg.offset + seg.numel] if got \
                    is not None else torch.zeros(seg.numel, dtype=ib.dtype)
        mine = self.host_phases.frames.pieces_of(self.local_rank)
        return OK, None, [by_name[self.pieces[i][0]] for i in mine], pending

    # --- state -------------------------------------------------------------------------------
    def held_residuals(self) -> Dict[int, torch.Tensor]:
        """:func:`host_state.held_residuals`."""
        return host_state.held_residuals(self)

    def residual_norm(self) -> float:
        own = sum(float(c.double().pow(2).sum()) for c in self.host_phases.carry.values())
        return own + (self.inner.residual_norm() if self.inner is not None else 0.0)

    def state_dict(self) -> dict:
        """This rank's piece of its host's exchange state, where it sits, and its carry."""
        return host_state.state_of(self)

    def validate_state_dict(self, state: dict) -> None:
        host_state.validate(self, state)

    def load_state_dict(self, state: dict) -> None:
        """Validate, then load ``state`` (a refused state changes nothing); the next step
        repeats the handshake."""
        steps = host_state.load(self, state)
        if self.inner is None:   # else the cross exchange counts them
            self._steps = steps
        self.agreement.reset()

