"""The collective phases of a step, push, aggregate and pull, with the bytes and seconds each
moves and takes (``comm_stats()``). :class:`~hvd_slim.exchange.step.SlimExchange` calls them
in the order it fixes; each takes the exchange whose worker, server, shards and transport it
uses."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, List, Optional

from ..wire import control
from ..wire import message as wm
from .expect import message_bound, pull_bounds, push_expect
from .sections import itemsizes

if TYPE_CHECKING:
    from .step import SlimExchange


def push(ex: "SlimExchange", sections: List[List[wm.Section]], report: Optional[str], t: int,
         flush: bool = False) -> Optional[List[Any]]:
    """Gather every rank's push for each shard (or NaN/Inf report) on its server: on a
    server, its shard's pushes in rank order; None elsewhere."""
    kind = wm.FLUSH_PUSH if flush else wm.PUSH
    bufs, bounds = [], []
    start = time.perf_counter()
    for s in range(ex.servers):
        buckets = ex.shards.shard_buckets(t, s)
        bound = message_bound(push_expect(buckets, flush=flush))
        if report is None:
            buf, sizes = ex.path.encode(kind, ex.rank, t, ex.digest, sections[s],
                                        itemsizes(buckets, sections[s]))
            ex.stats.record_push(buckets, sections[s], sizes)
        else:   # a NaN/Inf: report it instead of pushing; the servers decide for all
            buf = ex.path.from_host(control.encode_text(wm.NONFINITE, ex.rank, t,
                                                        ex.digest, report, limit=bound))
        bufs.append(buf)
        bounds.append(bound)
    before = ex.transport.stats.bytes_sent
    start = ex.stats.timed("prepare", start)   # encoding is local work before the push
    if ex.servers == 1:
        gather = lambda: ex.path.gather(ex.transport, bufs[0], ex.roots[0], bounds[0])
    else:
        gather = lambda: ex.path.gather_many(ex.transport, bufs, ex.roots, bounds)
    gathered = ex.collective(gather, f"the push of step {t}")
    ex.stats.timed("push", start)
    sent = ex.transport.stats.bytes_sent - before
    ex.stats.bytes_pushed += sent
    ex.stats.last["bytes_pushed"] = sent
    return gathered


def aggregate(ex: "SlimExchange", gathered: Optional[List[Any]], t: int,
              flush: bool = False) -> Any:
    """On a server: the reply to broadcast (its shard's pull, a SKIP, or an ERROR every rank
    raises, also for a failure of the server itself). None on the other ranks."""
    if ex.server is None:
        return None
    bound = _pull_bounds(ex, t, flush)[ex.shard]
    start = time.perf_counter()
    try:
        reply = ex.server.serve(gathered, t, ex.digest, flush, limit=bound)
        ex.stats.timed("serve", start)
        return reply
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it, then raise
        return ex.path.from_host(wm.encode_error(
            ex.rank, t, f"server rank {ex.rank} failed at step {t}: "
            f"{type(exc).__name__}: {exc}", limit=bound))


def pull(ex: "SlimExchange", reply: Any, t: int, flush: bool = False, defer: bool = False
         ) -> Optional[List[List[wm.Section]]]:
    """Broadcast every server's reply; every rank's decoded pull (per shard), or None for a
    step every rank skips (an ERROR raises). The servers settle the step here (what they
    planned is committed only when every shard's reply is a pull), unless ``defer``: then a
    pull leaves it to :meth:`SlimExchange.settle`."""
    sections = None
    try:
        bounds = _pull_bounds(ex, t, flush)
        before = ex.transport.stats.bytes_received
        if ex.servers == 1:
            bcast = lambda: [ex.path.broadcast(ex.transport, reply, ex.roots[0], bounds[0])]
        else:
            bcast = lambda: ex.path.broadcast_many(ex.transport, reply, ex.roots, bounds)
        start = time.perf_counter()
        bufs = ex.collective(bcast, f"the pull of step {t}")
        start = ex.stats.timed("pull", start)
        received = ex.transport.stats.bytes_received - before
        ex.stats.bytes_pulled += received
        ex.stats.last["bytes_pulled"] = received
        sections = ex.worker.read_pulls(bufs, t, flush)
        ex.stats.timed("apply", start)   # decoding the pull is the apply's first part
    finally:
        if ex.server is not None and not (defer and sections is not None):
            ex.server.settle(sections is not None)
    for s, (buf, secs) in enumerate(zip(bufs, sections or [])):
        ex.stats.record_pull(ex.shards.shard_buckets(t, s), buf, secs)
    return sections


def _pull_bounds(ex: "SlimExchange", t: int, flush: bool) -> List[int]:
    """:func:`~hvd_slim.exchange.expect.pull_bounds` of ``ex``'s shards and settings: the
    server's reply and every rank's broadcast are cut to the same bounds."""
    return pull_bounds(ex.shards, t, ex.cfg.pull, flush, ex.size)


def traffic(ex: "SlimExchange") -> tuple:
    """(bytes sent, bytes received) by this rank's transport so far."""
    stats = ex.transport.stats
    return stats.bytes_sent, stats.bytes_received


def count_traffic(ex: "SlimExchange", before: tuple) -> None:
    """Everything this rank's transport moved in the exchange (its server's share too)."""
    sent, received = (a - b for a, b in zip(traffic(ex), before))
    ex.stats.bytes_sent += sent
    ex.stats.bytes_received += received
    ex.stats.last.update(bytes_sent=sent, bytes_received=received)
