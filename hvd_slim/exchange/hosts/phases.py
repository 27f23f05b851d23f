"""The host phases of ``hierarchical=True`` (exchange/hosts/hierarchy.py): the collectives among the
L ranks of one host, over its local transport, in the byte layouts of exchange/hosts/wire.py.

* :meth:`HostPhases.reduce`: this rank's pieces of the step become the host's sum (or mean)
  of them, every local rank's carry added;
* :meth:`HostPhases.spread`: every local rank's pulled pieces (or verdict) to the host;
* :meth:`HostPhases.keep_own`: a step that failed before the host took this rank's gradient
  in keeps it in the carry, which the next reduction adds. The carry is forgotten
  (:meth:`HostPhases.taken`) only once the host's residuals hold it for good: its step
  committed, or failed after the reduction (absorbed there). A step dropped (a skip, a NaN/Inf
  under "raise") changes no residual, so its reduction of the carry is dropped too, and the
  carry stays for the next step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ...config import SlimConfig
from ...transport.base import Transport
from ..errors import ExchangeError, NonFiniteGradientError
from ..layout import SPARSE, Layout
from ..step import Pending
from ..timeout import watched
from .wire import BAD, CARRIED, FAILED, NONFINITE, OK, SKIPPED, HostFrames


@dataclass
class HostPrepared:
    """What ``HierarchicalExchange.prepare`` (exchange/hosts/hierarchy.py) read: step ``t``, this
    rank's own NaN/Inf report, and its host reduction's messages."""

    t: int
    report: Optional[str]
    payloads: List[Any]
    t0: float = 0.0   # when it began (a rank without pieces times its steps itself)


@dataclass
class HostPending:
    """A step ``HierarchicalExchange.begin`` has exchanged but not settled: the cross
    exchange's (None: this rank has no pieces, or it failed), and every local rank's pulled
    pieces (None: every rank skips it)."""

    t: int
    inner: Optional[Pending]
    pulled: Optional[List[tuple]]
    t0: float = 0.0


class HostPhases:
    """One rank's side of its host's collectives; ``stats`` counts their bytes."""

    def __init__(self, layout: Layout, config: SlimConfig, local: Transport, rank: int,
                 host: int, job_ranks: Sequence[int], stats: Any) -> None:
        self.layout, self.cfg, self.local, self.stats = layout, config, local, stats
        self.rank, self.host, self.me, self.size = rank, host, local.rank, local.size
        self.frames = HostFrames(layout, self.size)
        self.where = (f" (on host {host}'s transport, local rank j is job rank "
                      f"{list(job_ranks)}[j])")
        self.carry: Dict[int, torch.Tensor] = {}   # by compressed bucket, on the CPU
        self._reduced = (0, 0)   # bytes out and in of this step's reduction
        # Of the last reduction: whether a NaN/Inf poisoned the host's pieces. Of the last
        # spread: every local rank's verdict (None until one was read), the same on every rank
        # of the host, so each can tell which pieces a failed step kept (:meth:`absorbed`).
        self.poisoned = False
        self.verdicts: Optional[List[int]] = None

    def _watch(self, fn: Callable[[], Any], what: str) -> Any:
        return watched(self.local, self.cfg.timeout, fn, what, self.where)

    def encode(self) -> Tuple[List[np.ndarray], bool]:
        """The local half of :meth:`reduce`: this rank's gradient (plus its carry) copied into
        one message per local rank, and whether it holds a NaN/Inf. What the reduction sends
        is read here, so the script may clear ``p.grad`` before it runs (``overlap_forward``)."""
        check = self.cfg.nonfinite != "propagate"
        scale = self.layout.loss_scale.read()   # of this step's gradients, which the carry joins
        encoded = [self.frames.encode_reduce(j, check, self.carry, scale=scale)
                   for j in range(self.size)]
        bad = any(flag for _, flag in encoded)
        return [self.frames.flag(buf, bad) for buf, _ in encoded], bad

    def encode_carry(self) -> List[np.ndarray]:
        """:meth:`encode` of this rank's carry alone (a flush's), flagged when it has one."""
        # At the scale the cross exchange's absorb divides out (it reads the scaler's scale).
        scale = self.layout.loss_scale.read()
        return [self.frames.flag(self.frames.encode_reduce(j, False, self.carry, grads=False,
                                                           scale=scale)[0],
                                 False, bool(self.carry)) for j in range(self.size)]

    def reduce(self, t: int, pieces: Dict[int, tuple], payloads: List[np.ndarray]) -> bool:
        """Every piece of this rank (``pieces``: bucket index to (name, stand-in parameter))
        gets the host's sum (or mean) of it as its ``.grad``, from every local rank's
        :meth:`encode`. A NaN/Inf on any rank of the host poisons every piece, so every cross
        exchange sees it. Returns whether any local rank flagged a carry (:meth:`encode_carry`),
        the same on every rank of the host."""
        L, f = self.size, self.frames
        got = self._watch(lambda: self.local.gather_many(payloads, list(range(L)),
                                                         f.reduce_sizes),
                          f"the host reduction of step {t}")
        # Counted with the spread's (the cross exchange starts this step's figures afresh).
        self._reduced = (sum(len(p) for j, p in enumerate(payloads) if j != self.me),
                         sum(len(p) for j, p in enumerate(got) if j != self.me))
        try:
            mine = [f.decode_reduce(buf, self.me) for buf in got]
        except ValueError as exc:
            raise ExchangeError(f"rank {self.rank}: {exc}") from None
        poisoned = self.cfg.nonfinite != "propagate" and any(fl & BAD for _, fl in mine)
        self.poisoned = poisoned
        for k, i in enumerate(f.pieces_of(self.me)):
            acc = mine[0][0][k].clone()   # in local-rank order, the same on every run
            for parts, _ in mine[1:]:
                acc += parts[k]
            if self.cfg.op == "average":
                acc /= L
            if poisoned:
                acc.fill_(float("nan"))
            pieces[i][1].grad = acc.to(self.layout.buckets[i].device)
        return any(fl & CARRIED for _, fl in mine)

    def spread(self, t: int, status: int, error: Optional[BaseException],
               values: Sequence[torch.Tensor]) -> Optional[List[tuple]]:
        """Send this rank's pulled pieces (``values``, with ``status`` OK) or its verdict and
        ``error`` to the host. Returns every local rank's pieces, or None when the host skips;
        raises ``error``, or the error another local rank reported, on every rank alike."""
        L, f, me = self.size, self.frames, self.me
        self.verdicts = None
        if status == OK:
            payload = f.encode_spread(me, values)
        else:
            text = f"{type(error).__name__}: {error}" if error is not None else ""
            payload = f.encode_status(status, text)
        got = self._watch(lambda: self.local.broadcast_many(
            payload, list(range(L)), [f.spread_bound(j) for j in range(L)]),
            f"the host spread of step {t}")
        before, self._reduced = self._reduced, (0, 0)
        self.stats.add(local_bytes_sent=before[0] + len(payload) * (L - 1),
                        local_bytes_received=before[1] + sum(len(p) for j, p in enumerate(got)
                                                             if j != me))
        try:
            read = [f.decode_spread(buf, j) for j, buf in enumerate(got)]
        except ValueError as exc:
            raise ExchangeError(f"rank {self.rank}: {exc}") from None
        self.verdicts = [head for head, _ in read]
        for j, (head, body) in enumerate(read):
            if head in (FAILED, NONFINITE):
                if error is not None:
                    raise error
                cls = NonFiniteGradientError if head == NONFINITE else ExchangeError
                raise cls(f"rank {self.rank}: local rank {j} of host {self.host} failed: {body}")
        if any(head == SKIPPED for head, _ in read):
            return None
        return read

    def write(self, read: List[tuple], only_sparse: bool) -> None:
        """Every local rank's pulled pieces into this rank's ``p.grad``."""
        for b in self.layout.buckets:
            if only_sparse and b.kind != SPARSE:
                continue
            parts = [body[b.index] for _, body in read if b.index in body]
            Layout.write_grads(b, torch.cat(parts).to(b.device))

    def absorbed(self) -> Optional[List[bool]]:
        """After a spread that raised: per local rank, whether its cross exchange kept the
        host's reduced pieces in its residual (a failure: FAILED, or OK beside a FAILED mate),
        rather than dropping them (SKIPPED, NONFINITE, or all OK and NONFINITE: the step is
        dropped). A poisoned host's pieces were never pushed (their NaN/Inf was reported
        instead), so none kept them. None when no spread was read. The same on every rank of
        the host."""
        if self.verdicts is None:
            return None
        failed = FAILED in self.verdicts
        return [not self.poisoned and (v == FAILED or (v == OK and failed))
                for v in self.verdicts]

    def taken(self, pieces: Optional[Sequence[bool]] = None) -> None:
        """The host's residuals now hold this rank's carry (the step that reduced it committed,
        or kept the host's gradient in its residual pieces): forget it. ``pieces``: per local
        rank, whether its pieces took the carry in; the carry of the others stays for the next
        reduction (a step whose pieces were partly kept and partly dropped)."""
        if pieces is None or all(pieces):
            self.carry = {}
            return
        for j, took in enumerate(pieces):
            if took:
                for i, _, n in self.frames.places[j]:
                    if i in self.carry:
                        lo = self.frames.bounds[i][j]
                        self.carry[i][lo:lo + n] = 0

    def keep_own(self, payloads: Optional[List[np.ndarray]] = None) -> None:
        """This rank's gradient of the compressed buckets into its carry (checkpointed), so a
        failure before the host reduction loses none of it: from :meth:`encode`'s
        ``payloads`` (which hold the carry already) when given, else from ``p.grad``. The
        carry is kept in true units (the step's loss scale divided out: exact, a power of
        two), for the scale may change before a later step takes it in."""
        scale = self.layout.loss_scale.read()
        if payloads is not None:
            carry: Dict[int, torch.Tensor] = {}
            for j, buf in enumerate(payloads):
                parts, _ = self.frames.decode_reduce(buf, j)
                for (i, _, n), x in zip(self.frames.places[j], parts):
                    b = self.layout.buckets[i]
                    if b.kind == SPARSE:
                        lo = self.frames.bounds[i][j]
                        c = carry.setdefault(i, torch.zeros(b.numel, dtype=b.dtype))
                        c[lo:lo + n] = x if scale == 1.0 else x / scale
            self.carry = carry
            return
        for b in self.layout.sparse:
            c = self.carry.get(b.index)
            if c is None:
                c = self.carry[b.index] = torch.zeros(b.numel, dtype=b.dtype)
            for off, numel, g in Layout.grad_parts(b):
                if g is not None:
                    g = g.detach().reshape(-1).cpu()
                    c[off:off + numel] += g if scale == 1.0 else g / scale

    def flag_grads(self) -> None:
        """A step every rank skipped under ``nonfinite="flag"``: every gradient NaN (also
        of a parameter without one, as every rank's must be alike)."""
        for b in self.layout.buckets:
            for s in b.segments:
                if s.param.grad is not None:
                    s.param.grad.fill_(float("nan"))
                else:
                    s.param.grad = torch.full_like(s.param, float("nan"))
