"""Horovod's allreduce during a real backward pass: when the wire finishes, from when each
gradient was ready (the floor's measured ``backward_profile``, :mod:`benchmarks.ready`).

Horovod 0.28.1's background thread (horovod/common/operations.cc, ``RunLoopOnce``) sleeps until
one cycle (``HOROVOD_CYCLE_TIME``, 1 ms by default) after the previous cycle began, then takes
every tensor that all ranks have submitted, fuses them in order into buffers of at most the
fusion threshold (``HOROVOD_FUSION_THRESHOLD``, 128 MiB by default) and allreduces the buffers
one after another on that thread; the next cycle begins when they are done (or a cycle after
this one began, if later). :func:`wire_end` replays that loop over the ready times.

How the step is then predicted (:func:`overlapped`): the CPU path is the floor plus the local
work the peer adds (its fusion copies, MPI's sums, fp16 casts: with 2 ranks per core there is
no spare core, so all of it lengthens the step, as in the serial model); the wire path is the
wire's end plus what the floor does after ``backward()`` (the optimizer step). The step is the
later of the two. Nothing here is fitted: the ready times and the floor are measured, the cycle
and threshold are Horovod's defaults, and each buffer's allreduce is the serial model's.
"""
from __future__ import annotations

import math
from typing import Callable, List, Sequence, Tuple

from . import net as nw
from .scenario import Prediction, Scenario, allreduce, finish, ring_bytes

CYCLE_S = 1e-3                 # HOROVOD_CYCLE_TIME's default in 0.28.1 (operations.cc)
FUSION_BYTES = 128 << 20       # HOROVOD_FUSION_THRESHOLD's default in 0.28.1 (operations.cc)


def wire_end(ready: Sequence[Tuple[float, int]], itemsize: int,
             allreduce_s: Callable[[float], float], cycle_s: float = CYCLE_S,
             fusion_bytes: float = FUSION_BYTES) -> Tuple[float, List[float]]:
    """(When the last allreduce ends, the bytes of each fused buffer in order), seconds from
    the step's start. ``ready``: (seconds, elements) per tensor; ``allreduce_s(nbytes)``: one
    buffer's allreduce."""
    # stable: tensors ready together go in the order given
    todo = sorted(((t, n * itemsize) for t, n in ready), key=lambda x: x[0])
    buffers: List[float] = []
    now, start, i = 0.0, -cycle_s, 0
    while i < len(todo):
        start = max(start + cycle_s, now)
        if todo[i][0] > start:       # nothing ready: the loop idles, cycle by cycle
            start += math.ceil((todo[i][0] - start) / cycle_s - 1e-9) * cycle_s
        cycle: List[float] = [0.0]
        while i < len(todo) and todo[i][0] <= start:
            if cycle[-1] and cycle[-1] + todo[i][1] > fusion_bytes:
                cycle.append(0.0)
            cycle[-1] += todo[i][1]
            i += 1
        now = start
        for b in cycle:
            now += allreduce_s(b)
        buffers += cycle
    return now, buffers


def horovod_overlapped(sc: Scenario, peer: str, itemsize: int, local: float) -> Prediction:
    """``horovod``/``horovod-fp16`` in a scenario with a measured backward profile: the step is
    the later of the CPU path (compute + ``local``) and the wire path (compute + the wire's end
    past ``backward()``); ``comm_s`` is that exposed wire time."""
    comm = nw.Cost()

    def one(nbytes: float) -> float:
        c = allreduce(sc, nbytes)
        comm.add(c)
        return c.seconds

    end, buffers = wire_end(sc.ready, itemsize, one)
    exposed = max(0.0, end - sc.backward_end_s)
    comm.seconds = exposed
    nbytes = itemsize * sc.d
    wire = ring_bytes(nbytes, sc.ranks)
    pred = finish(peer, sc, local, comm, wire, wire, handed=nbytes, allreduces=len(buffers),
                  overlapped=True, wire_end_s=end, backward_end_s=sc.backward_end_s)
    pred.seconds = sc.compute_s + max(local, exposed)
    return pred
