"""hvd_slim's push as a queue into the server's NIC, where the workers push when their own
local work ends rather than all at once.

:func:`.net.gather` sends every push at the same instant, so the server's ingress carries
``(n-1) * push`` bytes after the last worker is ready. Where the ranks outnumber the cores they
are not ready together: each rank's compensate, select and encode (its ``prepare`` phase,
``comm_stats()["prepare_seconds"]``) time-shares the cores with the others', and they end
milliseconds apart. A push leaves as soon as its rank is ready (hvd_slim's gather is
point-to-point; a push under the TCP BTL's eager limit is written out without waiting for
the server), so the pushes of the early ranks cross the server's NIC while the late ones
still compute. What the push adds to the step is then how long after the *last* rank is ready
the last push lands, which is what :func:`staggered_gather` returns.

The ready times are measured: the benchmark records every rank's ``prepare`` seconds in every
measured step (``rank_phase_steps_s``), on the calibration run, whose CPU contention is the
same as the validated run's (validate scales them by the load index). Each step's ready vector
is queued on its own, and the cost is the median over steps (step times are reported as
medians). With no ready times (the extrapolation, a core per rank) it is the plain gather.

The queue: the server's ingress serves pushes in the order they arrive, at its rate; its token
bucket (:class:`.net.Tokens`' rule) refills while it is idle and lets the first bytes after an
idle spell through at line speed. A push also cannot land before its sender's own NIC has sent
it (its bucket full: the sender was computing). On a shared link every byte crosses the one
link, so the queue is that link. Bytes counted on each NIC are the plain gather's.
"""
from __future__ import annotations

import statistics
from typing import Any, Dict, Sequence, Tuple

from . import net as nw

Ready = Tuple[Tuple[float, ...], ...]   # per measured step, every rank's seconds to its push


def ready_times(rec: Dict[str, Any], ranks: int) -> Ready:
    """Per measured step, every rank's ``prepare`` seconds (when its push leaves) from a peer's
    results record (``rank_phase_steps_s``: per rank, a ``{phase: seconds}`` per step); ()
    when the record has none for ``ranks`` ranks."""
    per_rank = rec.get("rank_phase_steps_s")
    if not per_rank or len(per_rank) != ranks:
        return ()
    steps = min(len(r) for r in per_rank)
    return tuple(tuple(float(per_rank[j][i]["prepare"]) for j in range(ranks))
                 for i in range(steps))


def scaled(ready: Ready, load: float) -> Ready:
    """Ready times measured in one sitting, in another whose CPU work runs ``load`` times as
    long (validate's load index)."""
    return tuple(tuple(t * load for t in vec) for vec in ready)


def _queue_end(net: nw.Network, n: int, root: int, each: float,
               ready: Sequence[float]) -> float:
    """When the last push lands, with rank j's push leaving at ``ready[j]`` (seconds)."""
    dst = 0 if net.shared else net.endpoint(root)
    rate = net.rate(dst) / 8.0                 # bytes per second
    burst = net.burst(dst)
    free_at, tokens = float("-inf"), burst     # the ingress: idle since long, bucket full
    end = max(ready)
    for t, j in sorted((ready[j], j) for j in range(n)
                       if j != root and (net.shared or net.endpoint(j) != dst)):
        start = max(t, free_at)
        tokens = min(burst, tokens + (start - free_at) * rate)   # first push: idle forever
        free = min(each, tokens)
        tokens -= free
        own = 0.0   # on a shared link the link is the queue; switched, the sender's NIC too
        if not net.shared:
            src = net.endpoint(j)
            own = max(0.0, each - net.burst(src)) / (net.rate(src) / 8.0)
        free_at = max(start + (each - free) / rate, t + own)
        end = max(end, free_at)
    return end


def staggered_gather(net: nw.Network, n: int, root: int, each: float,
                     ready: Sequence[Sequence[float]]) -> nw.Cost:
    """Every other rank sends ``each`` bytes to ``root`` when it is ready: ``ready`` holds one
    vector per measured step of every rank's ready time (seconds from the exchange's start).
    Seconds: the median over steps of how long after the last rank is ready the last push
    lands (plus one latency); NIC bytes: :func:`.net.gather`'s."""
    plain = nw.gather(net, n, root, each)
    if not ready or n < 2 or each <= 0:
        return plain
    for vec in ready:
        if len(vec) != n:
            raise ValueError(f"a ready vector has {len(vec)} times for {n} ranks")
    extra = statistics.median(_queue_end(net, n, root, each, vec) - max(vec) for vec in ready)
    return nw.Cost(extra + net.latency_s + (n - 1) * net.overhead_s, plain.tx, plain.rx,
                   plain.phases)
