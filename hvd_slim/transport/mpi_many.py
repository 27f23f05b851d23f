"""The point-to-point gather of :class:`~hvd_slim.transport.mpi.MpiTransport`, to one root or to
several at once (``gather_many``), and its concurrent ``broadcast_many``.

With S sharded servers, S gathers run one after another would each wait on one root's link;
here every rank posts its sends to all roots at once and every root receives from all ranks at
once, everything polled together against one deadline (:meth:`MpiTransport._poll`), so a
missing rank is still named. ``broadcast_many`` exchanges all roots' lengths in one
``Iallgather``, then moves every root's data in one nonblocking ``Iallgatherv`` (each root's
block straight to every rank; beyond an int's worth of bytes, one ``Ibcast`` per root, all in
flight at once).

Tags: every gather message carries :data:`TAG_GATHER`, single-root and many-root alike. That is
safe because in each call a root receives exactly one message from each other rank, and a rank
sends one message to a root exactly in the calls where that root is a root (so both sides count
the same calls); MPI never lets messages with the same source, tag and communicator overtake
each other, so the k-th message from j to r is matched by r's k-th receive from j.

Functions here take the transport ``tr`` (its ``comm``, ``rank``, ``size``, ``stats``,
``_check_usable`` and ``_poll``) and any 1-D byte buffer mpi4py takes (numpy, or a tensor through
DLPack).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from .base import LENGTH_BYTES, check_bound
from .bounds import check_length
from .mpi_comm import CHUNK

# Tag of the exchange's point-to-point gather (the exchange communicator is private to it).
TAG_GATHER = 0x5D1


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def _label(what: str, roots: Sequence[int]) -> str:
    """``gather to rank 3`` / ``gather to ranks 3, 0``: the op named in timeout errors."""
    return f"{what} rank{'s' if len(roots) > 1 else ''} {_ranks(roots)}"


class _Outbox:
    """This rank's payloads in flight to their roots, one Isend each."""

    def __init__(self, comm: Any, sends: Sequence[Tuple[int, Any]]) -> None:
        self.pending: Dict[int, Tuple[Any, int]] = {
            dest: (comm.Isend([buf, MPI.BYTE], dest=dest, tag=TAG_GATHER), len(buf))
            for dest, buf in sends}

    def done(self) -> bool:
        for dest in sorted(self.pending):
            if self.pending[dest][0].Test():
                del self.pending[dest]
        return not self.pending

    def stalled(self) -> str:
        if len(self.pending) == 1:
            [(dest, (_, n))] = self.pending.items()
            return (f"rank {dest} did not take this rank's {n}-byte payload (it died, hangs or "
                    f"is elsewhere)")
        if self.pending:
            return (f"rank(s) {_ranks(sorted(self.pending))} did not take this rank's payloads "
                    f"(they died, hang or are elsewhere)")
        return ""


class _Inbox:
    """A root's receives of one gather: per source, a matched probe (which gives the size, so
    payloads need no length word or padding), then an Irecv of exactly that many bytes."""

    def __init__(self, comm: Any, sources: Sequence[int], alloc: Callable[[int], Any]) -> None:
        self.comm, self.alloc = comm, alloc
        self.pending = set(sources)
        self.receiving: Dict[int, Tuple[Any, Any]] = {}
        self.got: Dict[int, Any] = {}
        self._status = MPI.Status()

    def done(self) -> bool:
        for j in sorted(self.pending):
            if j not in self.receiving:
                msg = self.comm.Improbe(source=j, tag=TAG_GATHER, status=self._status)
                if msg is None:
                    continue
                buf = self.alloc(self._status.Get_count(MPI.BYTE))
                self.receiving[j] = (msg.Irecv([buf, MPI.BYTE]), buf)
            req, buf = self.receiving[j]
            if req.Test():
                self.got[j] = buf
                self.pending.discard(j)
        return not self.pending

    def stalled(self) -> str:
        silent = sorted(self.pending - set(self.receiving))
        partial = sorted(self.pending & set(self.receiving))
        parts = []
        if silent:
            parts.append(f"rank(s) {_ranks(silent)} sent nothing")
        if partial:
            parts.append(f"rank(s) {_ranks(partial)} started but did not finish")
        return "; ".join(parts) or "every rank has sent"


def gather_many_buffers(tr: Any, payloads: Sequence[Any], roots: Sequence[int],
                        bounds: Sequence[Optional[int]], own: Callable[[], Any],
                        alloc: Callable[[int], Any]) -> Optional[List[Any]]:
    """``payloads[i]`` to ``roots[i]`` (checked distinct ranks), all concurrently. ``own()`` is
    a root's copy of the payload it keeps; ``alloc(n)`` makes the buffer a peer's ``n`` bytes are
    received into. A root returns every rank's payload for it in rank order, others None;
    counted as one gather per root, in ``roots`` order."""
    tr._check_usable()
    for payload, bound in zip(payloads, bounds):
        check_bound(payload, bound, tr.rank, "gather")  # point-to-point needs no padding
    me = list(roots).index(tr.rank) if tr.rank in roots else None
    outbox = _Outbox(tr.comm, [(r, p) for r, p in zip(roots, payloads) if r != tr.rank])
    inbox = None if me is None else \
        _Inbox(tr.comm, [j for j in range(tr.size) if j != tr.rank], alloc)

    def done() -> bool:
        sent = outbox.done()   # both sides are tested on every poll: each needs progress
        return (inbox is None or inbox.done()) and sent

    def stalled() -> str:
        if inbox is None:
            return outbox.stalled()
        return "; ".join(filter(None, [inbox.stalled(), outbox.stalled()]))

    tr._poll(done, _label("gather to", roots), me is not None, stalled)
    out = None
    if inbox is not None:
        inbox.got[tr.rank] = own()
        out = [inbox.got[j] for j in range(tr.size)]
    for i, payload in enumerate(payloads):
        received = 0 if i != me else sum(len(b) for b in out) + LENGTH_BYTES * tr.size
        tr.stats.record("gather", len(payload) + LENGTH_BYTES, received)
    return out


def broadcast_many_buffers(tr: Any, payload: Any, roots: Sequence[int],
                           bounds: Sequence[Optional[int]], alloc: Callable[[int], Any]
                           ) -> List[Any]:
    """Every root in ``roots`` (checked distinct ranks) sends its ``payload`` (None off the
    roots), all concurrently; ``alloc(n)`` makes the buffer another root's ``n`` bytes are
    received into. Returns the roots' payloads in ``roots`` order (a root's own is ``payload``
    itself); counted as one broadcast per root, in ``roots`` order."""
    tr._check_usable()
    me = list(roots).index(tr.rank) if tr.rank in roots else None
    if me is not None:
        check_bound(payload, bounds[me], tr.rank, "broadcast")
    op = _label("broadcast from", roots)
    # Every rank's length word (0 off the roots) in one collective instead of one per root.
    lengths = np.zeros(tr.size, dtype=np.int64)
    mine = np.array([0 if me is None else len(payload)], dtype=np.int64)
    req = tr.comm.Iallgather(mine, lengths)
    tr._poll(req.Test, op, me is not None,
             lambda: "a rank did not take part (it died, hangs or is elsewhere)")
    counts = [check_length(op, int(lengths[r]), r, tr.rank) if r in roots else 0
              for r in range(tr.size)]
    if sum(counts) <= CHUNK:
        outs = _allgatherv(tr, payload if me is not None else alloc(0), roots, counts, alloc,
                           op, me)
    else:
        outs = _ibcasts(tr, payload, roots, counts, alloc, op, me)
    for i, buf in enumerate(outs):
        n = len(buf) + LENGTH_BYTES
        tr.stats.record("broadcast", n if i == me else 0, n)
    return outs


def _allgatherv(tr: Any, payload: Any, roots: Sequence[int], counts: List[int],
                alloc: Callable[[int], Any], op: str, me: Optional[int]) -> List[Any]:
    """Every root's payload in one ``Iallgatherv`` into one buffer (the others contribute
    nothing): each root sends its block straight to every rank, so every NIC carries about
    one block per root and no rank forwards another's, unlike S binomial or chain
    ``Ibcast`` trees, whose inner ranks forward for every root."""
    displs = [0] * tr.size
    for r in range(1, tr.size):
        displs[r] = displs[r - 1] + counts[r - 1]
    recv = alloc(sum(counts))
    req = tr.comm.Iallgatherv([payload, MPI.BYTE], [recv, counts, displs, MPI.BYTE])
    tr._poll(req.Test, op, me is not None,
             lambda: "a rank did not take part (it died, hangs or is elsewhere)")
    return [payload if i == me else recv[displs[r]:displs[r] + counts[r]]
            for i, r in enumerate(roots)]


def _ibcasts(tr: Any, payload: Any, roots: Sequence[int], counts: List[int],
             alloc: Callable[[int], Any], op: str, me: Optional[int]) -> List[Any]:
    """Every root's payload by its own chunked ``Ibcast``, all in flight at once (payloads
    too large for one ``Iallgatherv``'s int counts)."""
    outs: List[Any] = []
    pending: List[Tuple[int, Any]] = []
    for i, root in enumerate(roots):
        n = counts[root]
        buf = payload if i == me else alloc(n)
        outs.append(buf)
        # Every rank knows every length now, so empty payloads are skipped alike everywhere,
        # and all Ibcasts are started in the same order on every rank, as MPI requires.
        pending += [(root, tr.comm.Ibcast(buf[lo:lo + CHUNK], root=root))
                    for lo in range(0, n, CHUNK)]

    def done() -> bool:
        pending[:] = [(r, q) for r, q in pending if not q.Test()]
        return not pending

    def stalled() -> str:
        waiting = sorted({r for r, _ in pending} - {tr.rank})
        parts = [f"rank(s) {_ranks(waiting)} did not send"] if waiting else []
        if any(r == tr.rank for r, _ in pending):
            parts.append("a rank did not take this rank's payload (it died, hangs or is "
                         "elsewhere)")
        return "; ".join(parts) or "every root has sent"

    tr._poll(done, op, me is not None, stalled)
    return outs
