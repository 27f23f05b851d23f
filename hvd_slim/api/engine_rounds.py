"""The header round that starts every tensor-API call the engine (:mod:`.engine`) runs.

Each call begins with one allgather of a fixed-width int64 row per rank, its *header*: what the
call is (allreduce, allgather, broadcast, barrier, join, or another call by name), the
signature the ranks must agree on (dtype, shape, op or root, scale factors) and, for an
allreduce, how many queued allreduces this rank could fuse into the same message. Because the
width is fixed, ranks that make different calls meet in the same allgather and all raise one
:class:`MismatchError` instead of truncating each other's messages. Everything a rank does after
the round is a function of the rows every rank holds, which is what lets a rank that has called
``join`` serve the others' collectives: it reads what they do from their rows and takes part
(zeros for an allreduce, nothing for a barrier), while they refuse what Horovod refuses under
join (allgather, broadcast, anything else). A ``DistributedOptimizer`` on the whole job starts
each exchange (STEP) and flush (FLUSH) with a round too, so a joined rank runs that exchange
with zero gradients (:mod:`hvd_slim.api.join`).

The joined ranks are recorded per round on the job's own group (:class:`JoinState`); every rank
sees the same rows, so all agree on who joined when, and so on the last rank to join.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..transport.base import TransportError
from .checks import MismatchError

ALLREDUCE, ALLGATHER, BROADCAST, BARRIER, JOIN, GENERIC, STEP, FLUSH = 1, 2, 3, 4, 5, 6, 7, 8
_KIND_NAMES = {ALLREDUCE: "allreduce", ALLGATHER: "allgather", BROADCAST: "broadcast",
               BARRIER: "barrier", JOIN: "join", GENERIC: "call", STEP: "optimizer step",
               FLUSH: "optimizer flush"}
EXCHANGES = (STEP, FLUSH)    # a DistributedOptimizer's exchange; column 5 holds its id
MAGIC = 0x5D1A << 8          # in column 0, with the kind: a row that lacks it is not a header
FUSE_MAX = 16                # the most allreduces one message carries
FUSE_BYTES = 64 << 20        # and the most bytes (Horovod's default fusion threshold)
# Columns: 0 magic|kind, 1 crc of the call, 2 crc of the dtype, 3 ndim, 4 crc of the compared
# shape, 5 op or root, 6 work dtype code, 7-8 pre/postscale bits, 9 fusable count, 10 dim 0,
# 11 whether a barrier is queued behind (bit 0) and the second looks this rank has taken at the
# call (the bits above: Round.second_look), then FUSE_MAX prefix checksums and FUSE_MAX
# cumulative element counts.
_COMPARED = 9
_COUNT, _DIM0, _BEHIND, _PREFIX = 9, 10, 11, 12
_NUMEL = _PREFIX + FUSE_MAX
WIDTH = _NUMEL + FUSE_MAX
# A barrier meets a call still pending on another rank whose header did not say a barrier is
# queued behind it: perhaps only not yet (its header went out before its caller queued the
# barrier, a barrier called right after an async call). The ranks meet again this many times,
# the pending rank looking at its queue afresh each time, before the mismatch stands.
LOOKS = 10
# Dtypes a joined rank may have to build zeros of (an allreduce's reduced dtype), by code.
WORK_DTYPES = [None, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
               torch.float32, torch.float64]
MPI_OP = {0: "sum", 1: "sum", 3: "min", 4: "max", 5: "prod"}   # Horovod op -> MPI op


class JoinedError(RuntimeError):
    """A collective Horovod does not run while a rank has joined (allgather, broadcast, ...)."""


def _crc(obj: Any) -> int:
    return zlib.crc32(repr(obj).encode())


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


@dataclass
class Sig:
    """What one call passes that every rank must agree on, and how it is described in errors.
    ``call`` names the public call (GENERIC calls are compared by it); ``extra`` holds an
    allreduce's ``op`` or a broadcast's ``root_rank``."""
    kind: int
    call: str
    dtype: Optional[torch.dtype] = None
    shape: Tuple[int, ...] = ()
    dim0_free: bool = False
    extra: Dict[str, int] = field(default_factory=dict)
    work: Optional[torch.dtype] = None
    scale: Tuple[float, float] = (1.0, 1.0)

    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def fuse_key(self) -> Optional[tuple]:
        """Allreduces with equal keys may share one message (None: this call never fuses)."""
        if self.kind != ALLREDUCE:
            return None
        return (self.work, tuple(self.extra.values()), self.scale)

    def columns(self) -> List[int]:
        """Columns 0-8 and 10 of the header row."""
        shape = self.shape[1:] if self.dim0_free else self.shape
        dtype = 0 if self.dtype is None else _crc(self.dtype)
        work = WORK_DTYPES.index(self.work) if self.work in WORK_DTYPES else 0
        return [MAGIC | self.kind, _crc(self.call) if self.kind in (GENERIC, *EXCHANGES) else 0, dtype,
                len(self.shape), _crc(shape), int(next(iter(self.extra.values()), 0)), work,
                _bits(self.scale[0]), _bits(self.scale[1])]

    def describe(self) -> str:
        if self.kind in (BARRIER, JOIN, GENERIC, *EXCHANGES):
            return ""
        return f"{str(self.dtype).replace('torch.', '')} shape {list(self.shape)}" + "".join(
            f" {k}={v}" for k, v in self.extra.items())


def header(first: Sig, fusable: Sequence[Sig] = (), barrier_behind: bool = False,
           looks: int = 0) -> np.ndarray:
    """This rank's row for a call with signature ``first``, followed in its queue by the
    allreduces ``fusable`` that could share its message and, if ``barrier_behind``, by a
    barrier on the same group; ``looks``: the second looks this rank has taken at the call
    (:meth:`Round.second_look`)."""
    if not 0 <= looks <= LOOKS:
        raise ValueError(f"looks must be in [0, {LOOKS}], got {looks}")
    row = np.zeros(WIDTH, dtype=np.int64)
    row[:_COMPARED] = first.columns()
    row[_DIM0] = first.shape[0] if first.shape else 0
    row[_BEHIND] = int(barrier_behind) | (looks << 1)
    sigs = [first, *fusable][:FUSE_MAX] if first.kind == ALLREDUCE else [first]
    row[_COUNT] = len(sigs)
    chain, total = 0, 0
    for j, s in enumerate(sigs):
        # Equal prefix checksums: the ranks' first j+1 allreduces have the same layout.
        chain = zlib.crc32(repr((s.columns(), s.shape)).encode(), chain)
        total += s.numel()
        row[_PREFIX + j], row[_NUMEL + j] = chain, total
    return row


@dataclass
class Round:
    """Every rank's header row of one call, and what follows from them."""
    rows: np.ndarray

    @property
    def joined(self) -> List[int]:
        return [r for r, row in enumerate(self.rows) if row[0] == MAGIC | JOIN]

    @property
    def active(self) -> List[int]:
        return [r for r, row in enumerate(self.rows) if row[0] != MAGIC | JOIN]

    def kind(self) -> int:
        """The active ranks' call (JOIN when every rank has joined)."""
        active = self.active
        return int(self.rows[active[0], 0] & 0xFF) if active else JOIN

    def agreed(self) -> bool:
        """Whether the ranks that have not joined passed matching calls."""
        rows = self.rows[self.active, :_COMPARED]
        return bool((rows == rows[:1]).all())

    def catch_up(self) -> bool:
        """Whether the ranks that are not in a barrier should run the barrier they have queued
        first: some ranks wait in a barrier while every other one has a barrier queued behind
        calls still pending (Horovod matches calls by name, so a barrier overtakes them)."""
        split = self._barrier_split()
        return split is not None and bool((split[0][~split[1], _BEHIND] & 1).all())

    def second_look(self) -> bool:
        """Whether the ranks meet again rather than raise a mismatch (ask after
        :meth:`catch_up`): some ranks wait in a barrier, the others are at calls still pending
        and have not all said a barrier is queued behind, and no rank has looked :data:`LOOKS`
        times yet. Every rank decides alike from the rows (the most looks any rank reports)."""
        split = self._barrier_split()
        return split is not None and int((split[0][:, _BEHIND] >> 1).max()) < LOOKS

    def _barrier_split(self) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """The active ranks' rows and which of them wait in a barrier, where some do and the
        others do not (what :meth:`catch_up` and :meth:`second_look` read); else None."""
        rows = self.rows[self.active]
        barrier = rows[:, 0] == MAGIC | BARRIER
        return (rows, barrier) if barrier.any() and not barrier.all() else None

    def fused(self) -> int:
        """How many allreduces the next message carries: the longest prefix every active rank
        has queued with the same layout."""
        rows = self.rows[self.active]
        most = int(rows[:, _COUNT].min())
        prefixes = rows[:, _PREFIX:_PREFIX + most]
        same = (prefixes == prefixes[:1]).all(axis=0)
        return most if same.all() else max(1, int(np.argmin(same)))

    def zeros(self) -> Optional[Tuple[torch.Tensor, str]]:
        """A joined rank's contribution to the active ranks' allreduce, and its MPI op; None
        when they reduce a dtype MPI cannot (they raise TypeError and reduce nothing)."""
        row = self.rows[self.active[0]]
        dtype = WORK_DTYPES[int(row[6])]
        if dtype is None or int(row[5]) not in MPI_OP:
            return None
        return torch.zeros(int(row[_NUMEL + self.fused() - 1]), dtype=dtype), MPI_OP[int(row[5])]

    def exchange_id(self) -> int:
        """The id of the optimizer whose exchange the active ranks start (STEP or FLUSH)."""
        return int(self.rows[self.active[0], 5])

    def dim0s(self) -> np.ndarray:
        return self.rows[:, _DIM0].copy()


def exchange(api: Any, row: np.ndarray, what: str) -> Round:
    """The header round: allgather ``row``; a row that is not a header (a rank made a
    collective outside hvd_slim's API on its communicator, or ranks are out of step) raises on
    the rank that received it, naming the sender, before anything is sized from it."""
    rows = api.allgather_int64(row)
    me = api.rank
    for r, got in enumerate(rows):
        kind = int(got[0]) & 0xFF
        if int(got[0]) & ~0xFF != MAGIC or kind not in _KIND_NAMES or not 0 <= got[_DIM0] < 2 ** 48 \
                or not 0 < got[_COUNT] <= FUSE_MAX or not 0 <= got[_BEHIND] < 2 * (LOOKS + 1) \
                or (got[_NUMEL:] < 0).any():
            raise TransportError(f"rank {me}: {what}: rank {r} sent {got[:4].tolist()}... where "
                                 f"an hvd_slim call header belongs; the ranks' collectives are out "
                                 f"of step (every rank must make the same calls in the same order)")
    return Round(rows)


def explain(api: Any, rnd: Round, mine: Sig, what: str) -> MismatchError:
    """Collective, after a round that did not agree (every rank, a joined one too, comes
    here): the error naming what each rank passed."""
    text = "joined" if mine.kind == JOIN else f"{mine.call}\n{mine.describe()}"
    descs = [d.tobytes().decode("utf-8", "replace") for d in
             api.allgather_bytes(np.frombuffer(text.encode(), dtype=np.uint8))]
    parts = [d.partition("\n") for d in descs]
    calls = {c for r, (c, _, _) in enumerate(parts) if r in rnd.active}
    if len(calls) > 1 or mine.kind in (BARRIER, GENERIC, JOIN, *EXCHANGES):
        listing = "; ".join(f"rank {r}: {c} {d}".rstrip() for r, (c, _, d) in enumerate(parts))
        return MismatchError(f"{what}: ranks made different calls ({listing}); every rank must "
                             f"call the same collectives in the same order")
    listing = "; ".join(f"rank {r}: {d}" for r, (_, _, d) in enumerate(parts) if r in rnd.active)
    rule = "the same dtype and trailing dimensions" if mine.dim0_free else "the same dtype and shape"
    if mine.kind == ALLREDUCE:
        rule += " and the same prescale_factor and postscale_factor"
    return MismatchError(f"{what}: ranks passed mismatched arguments ({listing}); every rank must "
                         f"pass {rule}" + (" and the same " + ", ".join(mine.extra) if mine.extra else ""))


def joined_refusal(rnd: Round, what: str) -> JoinedError:
    ranks = ", ".join(map(str, rnd.joined))
    return JoinedError(f"{what}: rank(s) {ranks} have called hvd.join(); while a rank has joined "
                       f"only allreduce and barrier run (joined ranks contribute zeros), as in "
                       f"Horovod; make this call before join()")


class JoinState:
    """Who has joined, in the order of the rounds that showed it, on the job's group, and
    which optimizers stepped meanwhile."""

    def __init__(self) -> None:
        self.joined: List[int] = []
        self.served: List[int] = []   # ids of optimizers that exchanged while a rank had joined

    def observe(self, rnd: Round) -> Optional[Tuple[int, List[int]]]:
        """Record a round; when every rank has joined, return the last one to join (the
        highest rank among those that joined in the same round) and the optimizers served
        meanwhile (in the order first served), and start afresh."""
        for r in rnd.joined:
            if r not in self.joined:
                self.joined.append(r)
        if rnd.joined and rnd.kind() in EXCHANGES and rnd.exchange_id() not in self.served:
            self.served.append(rnd.exchange_id())
        if len(rnd.joined) < len(rnd.rows):
            return None
        out = (self.joined[-1], self.served)
        self.joined, self.served = [], []
        return out
