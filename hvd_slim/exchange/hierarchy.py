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
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..config import ConfigError, SlimConfig
from ..transport.base import Transport, TransportTimeout
from . import checkpoint, handshake
from .errors import TIMEOUT_ADVICE, ExchangeError, NonFiniteGradientError
from .host_wire import FAILED, NONFINITE, OK, SKIPPED, HostFrames
from .layout import SPARSE, Layout
from .stats import ExchangeStats
from .step import SlimExchange


def host_table(hosts: Sequence[int]) -> List[List[int]]:
    """The ranks of each host (hosts numbered 0..H-1, each host's ranks in rank order) from each
    rank's host number; a ValueError naming the hosts unless every host has as many ranks."""
    by_host: Dict[int, List[int]] = {}
    for r, h in enumerate(hosts):
        by_host.setdefault(int(h), []).append(r)
    table = [by_host[h] for h in sorted(by_host)]
    if len({len(t) for t in table}) > 1:
        listed = "; ".join(f"host {h} has {len(t)} (ranks {', '.join(map(str, t))})"
                           for h, t in enumerate(table))
        raise ConfigError(f"hierarchical=True needs as many ranks on every host, but {listed}. "
                          "Launch the same number of ranks per host, or pass "
                          "hierarchical=False", "hierarchical")
    return table


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
        self.frames = HostFrames(layout, self.local_size)
        self.bounds = self.frames.bounds
        self.pieces, self.inner = self._build_inner(momentum or {}, hosts)
        self.servers = self.inner.servers if self.inner is not None else 1
        # The cross exchange's figures (bytes that crossed a NIC), measured against what a
        # dense allreduce of the whole model among every rank would move.
        self.stats = self.inner.stats if self.inner is not None else \
            ExchangeStats(layout, self.size)
        whole = ExchangeStats(layout, self.size)
        self.stats.grad_bytes, self.stats.ring_bytes = whole.grad_bytes, whole.ring_bytes
        self.stats.compressed_grad_bytes = whole.compressed_grad_bytes
        self.table = table
        self._reduced = (0, 0)   # bytes out and in of this step's host reduction
        self._steps = 0   # steps, when this rank has no pieces (and so no cross exchange)
        self._agreed = False

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
        inner_cfg = dataclasses.replace(self.cfg, hierarchical=False,
                                        server_rank=int(hosts[self.cfg.server_rank]))
        object.__setattr__(inner_cfg, "_env_sources", getattr(self.cfg, "_env_sources", {}))
        comm_dtype = {b.dtype: b.comm_dtype for b in self.layout.buckets}
        inner_layout = Layout(list(pieces.values()), inner_cfg, lambda dt: comm_dtype[dt],
                              kinds=kinds)
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
        t = self.step_count
        self._handshake(t)
        self._reduce(t)
        verdict = self._run_inner(self.inner.step if self.inner is not None else lambda: True)
        status = self._spread(t, verdict, only_sparse=False)
        if status == SKIPPED:
            if self.cfg.nonfinite == "flag":
                for b in self.layout.buckets:
                    for s in b.segments:
                        if s.param.grad is not None:
                            s.param.grad.fill_(float("nan"))
                        else:
                            s.param.grad = torch.full_like(s.param, float("nan"))
            return False
        if self.inner is None:
            self._steps += 1
        return True

    def flush(self) -> None:
        """:meth:`SlimExchange.flush`: every residual of every host sent densely into the
        compressed ``p.grad``; dense-bucket grads are untouched."""
        t = self.step_count
        self._handshake(t)
        for name, p in self.pieces.values():
            p.grad = None   # the flush fills the compressed pieces only
        verdict = self._run_inner(self.inner.flush if self.inner is not None else lambda: True)
        self._spread(t, verdict, only_sparse=True)

    def _handshake(self, t: int) -> None:
        """Once (and after a load): all ranks of the job agree on the model and settings (the
        same collective as a flat exchange's, so a rank without ``hierarchical`` is named)."""
        if not self._agreed:
            self._watch(self.transport, lambda: handshake.check_agreement(self, t),
                        f"the handshake of step {t}")
            self._agreed = True

    def _reduce(self, t: int) -> None:
        """Step 1: this rank's pieces' ``.grad`` become the host's sum (or mean) of them."""
        L, f = self.local_size, self.frames
        check = self.cfg.nonfinite != "propagate"
        encoded = [f.encode_reduce(j, check) for j in range(L)]
        bad = any(flag for _, flag in encoded)
        payloads = [f.flag(buf, bad) for buf, _ in encoded]
        got = self._watch(self.local, lambda: self.local.gather_many(
            payloads, list(range(L)), f.reduce_sizes), f"the host reduction of step {t}")
        # Counted with step 3's (the cross exchange starts this step's figures afresh).
        self._reduced = (sum(len(p) for j, p in enumerate(payloads) if j != self.local_rank),
                         sum(len(p) for j, p in enumerate(got) if j != self.local_rank))
        try:
            mine = [f.decode_reduce(buf, self.local_rank) for buf in got]
        except ValueError as exc:
            raise ExchangeError(f"rank {self.rank}: {exc}") from None
        poisoned = check and any(flag for _, flag in mine)
        for k, i in enumerate(f.pieces_of(self.local_rank)):
            acc = mine[0][0][k].clone()   # in local-rank order, the same on every run
            for parts, _ in mine[1:]:
                acc += parts[k]
            if self.cfg.op == "average":
                acc /= L
            if poisoned:   # every host piece reports it: every cross exchange skips alike
                acc.fill_(float("nan"))
            self.pieces[i][1].grad = acc.to(self.layout.buckets[i].device)

    def _run_inner(self, fn: Any) -> tuple:
        """Step 2, with its outcome as the verdict step 3 sends (an error is raised after it)."""
        try:
            return (OK if fn() is not False else SKIPPED), None
        except NonFiniteGradientError as exc:
            return NONFINITE, exc
        except Exception as exc:  # noqa: BLE001 - the host must learn of it, then it is raised
            return FAILED, exc

    def _spread(self, t: int, verdict: tuple, only_sparse: bool) -> int:
        """Step 3: every local rank sends its pulled pieces (or its verdict) to the host; every
        rank writes the whole update. Returns the host's verdict; raises a shared error."""
        status, exc = verdict
        L, f, me = self.local_size, self.frames, self.local_rank
        if status == OK:
            mine = [self.pieces[i][1] for i in f.pieces_of(me)]
            payload = f.encode_spread(me, [torch.zeros_like(p) if p.grad is None else p.grad
                                           for p in mine])
        else:
            payload = f.encode_status(status, f"{type(exc).__name__}: {exc}" if exc else "")
        got = self._watch(self.local, lambda: self.local.broadcast_many(
            payload, list(range(L)), [f.spread_bound(j) for j in range(L)]),
            f"the host spread of step {t}")
        before, self._reduced = self._reduced, (0, 0)
        self._count_local(before[0] + len(payload) * (L - 1),
                          before[1] + sum(len(p) for j, p in enumerate(got) if j != me))
        try:
            read = [f.decode_spread(buf, j) for j, buf in enumerate(got)]
        except ValueError as exc:
            raise ExchangeError(f"rank {self.rank}: {exc}") from None
        for j, (head, body) in enumerate(read):
            if head in (FAILED, NONFINITE):
                if exc is not None:
                    raise exc
                cls = NonFiniteGradientError if head == NONFINITE else ExchangeError
                raise cls(f"rank {self.rank}: local rank {j} of host {self.host} failed: {body}")
        if any(head == SKIPPED for head, _ in read):
            return SKIPPED
        for b in self.layout.buckets:
            if only_sparse and b.kind != SPARSE:
                continue
            parts = [body[b.index] for _, body in read if b.index in body]
            Layout.write_grads(b, torch.cat(parts).to(b.device))
        return OK

    def _count_local(self, out: int, into: int) -> None:
        """Bytes this rank's host phases sent to and received from its host's other ranks."""
        self.stats._add(local_bytes_sent=out, local_bytes_received=into)

    def _watch(self, transport: Transport, fn: Any, what: str) -> Any:
        """Run collectives under the exchange timeout; a timeout on the host's transport says
        which job ranks its local ranks are."""
        try:
            with transport.watch(self.cfg.timeout, what):
                return fn()
        except TransportTimeout as exc:
            where = "" if transport is self.transport else (
                f" (on host {self.host}'s transport, local rank j is job rank "
                f"{self.table[self.host]}[j])")
            raise TransportTimeout(f"{exc}{where}. {TIMEOUT_ADVICE} (now {self.cfg.timeout:g} s)"
                                   ) from None

    # --- state -------------------------------------------------------------------------------
    def held_residuals(self) -> Dict[int, torch.Tensor]:
        """:meth:`SlimExchange.held_residuals` in the units of a flat exchange: this rank's
        pieces of its host's residuals (and of the server's), times the host's ranks under
        ``op="average"`` (a host residual is of the host's mean)."""
        out = {b.index: torch.zeros(b.numel, dtype=torch.float64) for b in self.layout.sparse}
        if self.inner is None:
            return out
        scale = self.local_size if self.cfg.op == "average" else 1
        name_of = {name: i for i, (name, _) in self.pieces.items()}
        held = self.inner.held_residuals()
        for ib in self.inner.layout.sparse:
            i = name_of[ib.segments[0].name]
            lo, hi = self.bounds[i][self.local_rank:self.local_rank + 2]
            out[i][lo:hi] = held[ib.index].cpu() * scale
        return out

    def residual_norm(self) -> float:
        return self.inner.residual_norm() if self.inner is not None else 0.0

    def state_dict(self) -> dict:
        """This rank's piece of its host's exchange state, and where it sits."""
        return {"version": checkpoint.VERSION, "rank": self.rank, "size": self.size,
                "hierarchical": {"hosts": self.hosts, "local_size": self.local_size,
                                 "local_rank": self.local_rank},
                "inner": self.inner.state_dict() if self.inner is not None else None}

    def validate_state_dict(self, state: dict) -> None:
        where = {"hosts": self.hosts, "local_size": self.local_size,
                 "local_rank": self.local_rank}
        if not isinstance(state, dict) or "hierarchical" not in state:
            raise ValueError("hvd_slim checkpoint was made without hierarchical=True (a flat "
                             "exchange's state); resume with the keywords it was saved with")
        if state.get("rank") != self.rank or state.get("size") != self.size \
                or state["hierarchical"] != where:
            raise ValueError(f"hvd_slim checkpoint holds rank {state.get('rank')} of "
                             f"{state.get('size')} at {state['hierarchical']}; this is rank "
                             f"{self.rank} of {self.size} at {where}. {checkpoint.FIX_RANK}")
        if self.inner is not None:
            self.inner.validate_state_dict(state.get("inner"))

    def load_state_dict(self, state: dict) -> None:
        self.validate_state_dict(state)
        if self.inner is not None:
            self.inner.load_state_dict(state["inner"])
        self._agreed = False
