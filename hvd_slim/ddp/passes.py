"""Where the hook's bucket exchanges run: on a communication thread of the state's own, so that
backward goes on while a bucket is exchanged, as DDP's own allreduce overlaps it.

Every rank must make the exchanges' collectives in the same order. DDP hands its buckets over
in the same order on every rank, and one thread runs them in the order they were started. An
exchange that fails ends the pass there: the ones started after it do not begin (they are
absorbed when the pass settles), so no rank waits in a collective the others never make. Where
the transport allows no second thread, each exchange runs inline, as it is started.
"""
from __future__ import annotations

import concurrent.futures
from typing import Any, Optional

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
