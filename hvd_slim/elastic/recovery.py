"""After a failed collective: the surviving ranks agree who is alive and rebuild hvd_slim on
themselves (the ``reset`` of :func:`hvd_slim.elastic.run`).

Why this works over plain Open MPI (no ULFM): under ``mpirun --enable-recovery`` the job
survives a process's death; a collective with the dead rank never completes, and hvd_slim's
timeout (``HVD_SLIM_TIMEOUT``) ends it with a ``TransportTimeout`` on every survivor. Point to
point messages between live ranks still flow, and ``MPI_Comm_create_group`` is collective over
the listed ranks only, so the survivors can build a communicator without the dead one.

The protocol, on COMM_WORLD with tags of its own (hvd_slim's collectives run on private Dups),
each message ``[generation, kind, members...]``:

1. every rank that enters recovery sends HELLO to every member of the current job;
2. the lowest rank heard from (itself included) coordinates: once it has heard from every
   member, or :func:`window` seconds after it entered, it sends DECISION (the members heard,
   in COMM_WORLD order) to every member of the old job, dead ones included (unmatched);
3. every rank takes the first DECISION it receives; one left out of it exits (quietly, without
   aborting the others); the rest shut hvd_slim down and ``init(comm=members)``.

Ranks enter recovery at different times: a rank waiting on the server times out up to
``min(0.5 * timeout, 30)`` s plus the roll call (5 s) after the server did. The window covers
that; a rank entering later than the window is left out, and a failure during recovery ends the
job (the next timeout aborts it, as without elastic).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, List, Optional

import numpy as np

from ..api import lifecycle
from ..api.timeout import api_timeout
from ..runtime import abort, basics

TAG_HELLO, TAG_DECISION = 0x5E1, 0x5E2
WINDOW_ENV = "HVD_SLIM_ELASTIC_WINDOW"

_generation = 0   # recoveries completed: every member counts the same


def members() -> List[int]:
    """The COMM_WORLD ranks of the current hvd_slim job, in its rank order."""
    from mpi4py import MPI
    group, world = basics.job_comm().Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return [int(r) for r in MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                                         world)]
    finally:
        group.Free()
        world.Free()


def window() -> float:
    """Seconds the coordinator waits for the other ranks to enter recovery: ``HVD_SLIM_ELASTIC_WINDOW``
    when set, else the skew the timeouts allow (see the module docstring) plus 5 s."""
    raw = os.environ.get(WINDOW_ENV)
    if raw:
        return float(raw)
    from ..transport.mpi_api import ROLL_CALL_S
    timeout = api_timeout() or 60.0
    return min(0.5 * timeout, 30.0) + min(ROLL_CALL_S, timeout) + 5.0


def _send(world: Any, dest: int, tag: int, body: List[int], kept: list) -> None:
    msg = np.array([_generation, *body], dtype=np.int64)
    kept.append(msg)
    try:
        kept.append(world.Isend(msg, dest=dest, tag=tag))
    except Exception:  # noqa: BLE001 - a dead destination: it needs no message
        pass


def _receive(world: Any, status: Any) -> Optional[tuple]:
    """One pending protocol message of this generation as (tag, source, body), or None. Stale
    messages of earlier generations are dropped."""
    from mpi4py import MPI

    # By tag, so that a user's own COMM_WORLD messages are never taken; decisions first.
    while (world.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_DECISION, status=status)
           or world.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_HELLO, status=status)):
        tag, source = status.Get_tag(), status.Get_source()
        buf = np.empty(status.Get_count(MPI.INT64_T), dtype=np.int64)
        world.Recv(buf, source=source, tag=tag)
        if int(buf[0]) == _generation:
            return tag, source, [int(x) for x in buf[1:]]
    return None


def agree(kept: list, wait: Optional[float] = None) -> List[int]:
    """Run the protocol; returns the survivors' COMM_WORLD ranks (this one among them)."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    me, old = world.Get_rank(), members()
    for j in old:
        if j != me:
            _send(world, j, TAG_HELLO, [], kept)
    heard = {me}
    wait = window() if wait is None else wait
    start, status = time.monotonic(), MPI.Status()
    while True:
        msg = _receive(world, status)
        if msg is not None:
            tag, source, body = msg
            if tag == TAG_DECISION:
                return body
            heard.add(source)
            continue
        late = time.monotonic() - start
        if min(heard) == me and (heard >= set(old) or late >= wait):
            decision = sorted(heard)
            for j in old:
                if j != me:
                    _send(world, j, TAG_DECISION, decision, kept)
            return decision
        if late >= 2 * wait + 10.0:
            raise RuntimeError(f"hvd_slim.elastic: rank {me} heard no decision from rank "
                               f"{min(heard)} within {late:.0f} s; recovery failed")
        time.sleep(0.005)


def recover(wait: Optional[float] = None) -> List[int]:
    """Agree on the survivors, then rebuild hvd_slim on them (``shutdown()``, then
    ``init(comm=survivors)``). Returns the survivors' COMM_WORLD ranks; exits this process (not
    the job) if it was left out."""
    global _generation
    from ..transport import mpi_comm
    kept: list = []   # send buffers and requests: MPI may still read them
    me = mpi_comm.world_rank_size()[0]
    old = members()
    survivors = agree(kept, wait)
    _generation += 1
    # The timed-out collectives are abandoned with the old communicators; recovery is how this
    # job goes on, so exit must not abort it any more (abort.end_job_at_exit).
    abort.forgive_abandoned()
    lost = sorted(set(old) - set(survivors))
    if lost:   # MPI_Finalize would wait for them (abort.leave_without_finalize)
        abort.leave_without_finalize(f"COMM_WORLD ranks {lost} were left behind")
    _kept.append(kept)
    if me not in survivors:
        sys.stderr.write(f"hvd_slim.elastic: COMM_WORLD rank {me} was left out of the survivors "
                         f"{survivors}; exiting\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)   # no MPI_Finalize: it would wait for the ranks that went on without it
    lifecycle.shutdown()
    lifecycle.init(comm=survivors)
    return survivors


_kept: List[list] = []   # every recovery's messages, alive until exit
