"""One backward pass of the DDP hook: its buckets' exchanges, started as DDP hands the buckets
over and settled together at the last one (:class:`BackwardPass`), and where they run
(:class:`Starter`).

The exchanges run on a communication thread of the state's own, so that backward goes on while
a bucket is exchanged, as DDP's own allreduce overlaps it. Every rank must make the exchanges'
collectives in the same order. DDP hands its buckets over in the same order on every rank, and
one thread runs them in the order they were started. An exchange that fails ends the pass
there: the ones started after it do not begin (they are absorbed when the pass settles), so no
rank waits in a collective the others never make. Where the transport allows no second thread,
each exchange runs inline, as it is started.
"""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch

from .buckets import Bucket, Keys

# A started exchange that did not begin because an earlier one of its pass failed.
NOT_BEGUN = object()


class Starter:
    """Starts each bucket's exchange (``exchange.begin()``) on the communication thread, or
    inline; :meth:`start` returns a ``concurrent.futures.Future`` of its pending step."""

    def __init__(self, threaded: bool) -> None:
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = \
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hvd_slim-ddp") \
            if threaded else None
        self._failed = False   # an exchange of this pass failed: the rest do not begin

    @property
    def threaded(self) -> bool:
        return self._pool is not None

    def start(self, exchange: Any) -> "concurrent.futures.Future[Any]":
        if self._pool is not None:
            return self._pool.submit(self._begin, exchange)
        out: "concurrent.futures.Future[Any]" = concurrent.futures.Future()
        try:
            out.set_result(self._begin(exchange))
        except BaseException as exc:  # noqa: BLE001 - read at the pass's end
            out.set_exception(exc)
        return out

    def _begin(self, exchange: Any) -> Any:
        if self._failed:
            return NOT_BEGUN
        try:
            return exchange.begin()   # a failure is settled by begin() itself
        except BaseException:
            self._failed = True
            raise

    def end_pass(self) -> None:
        """Every started exchange has been waited for: the next pass starts afresh."""
        self._failed = False

    def close(self) -> None:
        """End the communication thread once it is idle (not waited for: at exit a pass may
        have been left in flight)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


@dataclass
class InFlight:
    """One bucket of the backward pass in flight, from its hook call to the pass's end."""

    bucket: Bucket
    begun: Any                       # its exchange's start (a future); then what it gave
    fut: "torch.futures.Future[torch.Tensor]"   # what DDP waits for
    starts: Tuple[int, ...]          # where each stand-in's part lies in ``buffer``
    buffer: torch.Tensor             # DDP's flat bucket
    params: List[torch.Tensor]
    keys: Keys


class BackwardPass:
    """The buckets of the backward pass in flight, all or nothing as ``DistributedOptimizer``'s
    step: begun as they come, settled together at the last (committed, dropped when every rank
    skipped the pass, or, after an error, each keeping its gradient in its residuals).

    ``adam``, where the state has one, is its ``HookAdam``: the pass's moments follow the
    pass's outcome, and it is told what each bucket delivered."""

    def __init__(self) -> None:
        self.buckets: List[InFlight] = []
        self.failed: Optional[Exception] = None   # why this pass failed, if it did
        self.fresh = True                         # the next bucket begins a pass
        self._starter: Optional[Starter] = None   # made at the first bucket

    @property
    def threaded(self) -> Optional[bool]:
        """Whether the exchanges run on the communication thread (None before the first)."""
        return None if self._starter is None else self._starter.threaded

    def begin(self, b: Bucket, fut: "torch.futures.Future[torch.Tensor]",
              starts: Tuple[int, ...], buffer: torch.Tensor, params: List[torch.Tensor],
              keys: Keys, threaded: bool) -> None:
        """Start ``b``'s exchange (on the communication thread when ``threaded``, decided at
        the first bucket) for DDP's ``buffer``, ``fut`` to complete when the pass settles."""
        if self._starter is None:
            self._starter = Starter(threaded)
        self.buckets.append(InFlight(b, self._starter.start(b.exchange), fut, starts, buffer,
                                     params, keys))

    def settle(self, adam: Any, flag: bool) -> bool:
        """The pass's end: wait for every exchange it started, then commit or drop them all
        and complete every bucket's future (or, after an error, keep each one's gradient in its
        residual and fail them). Returns whether every rank skipped the pass (NaN/Inf):
        ``flag`` then makes every update NaN (``nonfinite="flag"``)."""
        for e in self.buckets:
            try:
                e.begun = e.begun.result()
            except Exception as exc:  # noqa: BLE001 - the pass fails with it
                e.begun = exc
                self.failed = self.failed or exc
        if self.failed is not None:
            self.fail(self.failed, None, adam)
            return False
        skipped = any(e.begun.pulled is None for e in self.buckets)
        for e in self.buckets:
            e.bucket.exchange.settle(e.begun, commit=not skipped)
        if adam is not None:
            adam.settle(keep=not skipped)
        if skipped and flag:
            for e in self.buckets:
                e.bucket.exchange.flag_grads()
        for e in self.buckets:
            result = e.bucket.deliver(e.buffer, e.starts)   # DDP's own buffer, as allreduce's
            if adam is not None:
                adam.deliver(e.params, result, e.keys, e.bucket.dense)
            e.fut.set_result(result)
        return skipped

    def fail(self, exc: Exception, fut: "Optional[torch.futures.Future[torch.Tensor]]",
             adam: Any) -> None:
        """The pass failed (``fut``: a bucket's future to fail too): what its exchanges began
        keeps its gradient in their residuals. Called in DDP's thread for an error there, and
        at the pass's end for one an exchange raised."""
        self.failed = exc
        for e in self.buckets:
            _absorb(e.bucket, e.begun)
            e.fut.set_exception(exc)
        self.buckets = []
        if adam is not None:   # the updates wait in the residuals: keep the moments
            adam.settle(keep=True)
        if fut is not None:
            fut.set_exception(exc)

    def end(self) -> None:
        """After the last bucket: the next one begins a new pass."""
        self.buckets, self.failed, self.fresh = [], None, True
        if self._starter is not None:
            self._starter.end_pass()

    @property
    def in_flight(self) -> bool:
        """Whether a pass has begun and not ended (its last bucket not yet come)."""
        return bool(self.buckets) or not self.fresh

    def close(self) -> None:
        """Forget a pass left in flight and end the communication thread."""
        self.end()
        if self._starter is not None:
            self._starter.close()


def _absorb(b: Bucket, pending: Any) -> None:
    """Keep a failed pass's gradient for ``b`` in its residual. ``pending``: what its start
    gave (still a future when DDP's thread failed: waited for here), :data:`NOT_BEGUN` (its
    proposals are made here), or the exception its ``begin()`` raised (which settled itself)."""
    if isinstance(pending, concurrent.futures.Future):
        try:
            pending = pending.result()
        except Exception:  # noqa: BLE001 - begin() settled its own failure
            return
    if isinstance(pending, Exception):
        return
    b.exchange.absorb(None if pending is NOT_BEGUN else pending)
