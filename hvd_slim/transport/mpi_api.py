"""The public tensor API's collectives over mpi4py: :class:`MpiCollectives`, on numpy buffers.

The API (``hvd_slim.allreduce``, ``broadcast``, ``allgather``, the object and parameter helpers,
``join``, ``barrier``) gets one instance from the runtime, on the job communicator
(:func:`hvd_slim.runtime.basics.job_collectives`), as the exchange gets its transport, and hands
in numpy views that alias tensor memory. Each collective is started nonblocking
(``Iallreduce``, ``Ireduce_scatter``, ``Ibcast``, ``Iallgather(v)``, ``Ialltoallv``, ``Ibarrier``,
and ``Isend``/``Irecv`` pairs for Adasum) and polled
(:func:`~hvd_slim.transport.deadline.poll_until`) against the deadline of
:meth:`~hvd_slim.transport.base.Deadlines.watch`, the timeout mechanism every transport uses, so
a rank that never arrives ends the call with a :class:`TransportTimeout` instead of a hang.

Who did not arrive: a collective cannot tell, so on a timeout every rank that gave up sends a
*roll call* (how many collectives it has made on the communicator, and the watch label) to
every other rank, point to point on the same communicator (MPI keeps that traffic apart from
collectives), and listens for the others' for a short grace. A rank heard from with the same
count arrived too; one heard from elsewhere is named with the call it waits in; one not heard
from did not arrive.

An abandoned collective can never be matched again in order, so after a timeout the instance
is retired (every later call raises at once) and the request and its buffers are kept alive with
it: MPI may still write into them.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from .api_base import REDUCIBLE as _REDUCIBLE
from .api_base import ROLL_CALL_S, ApiCollectives, roll_call_verdict
from .api_base import flat as _flat
from .api_base import offsets as _offsets
from .base import TransportError, TransportTimeout
from .bounds import check_length
from .deadline import poll_until
from .mpi_comm import CHUNK, mpi_errors

_OPS = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}
_TAG_ROLL_CALL = 0x5D2
_TAG_PAIR = 0x5D3   # sendrecv_bytes (Adasum's pairwise exchange)
_INT_MAX = (1 << 31) - 1


def _roll_call(comm: Any, n: int, label: str, grace: float, kept: list) -> str:
    """Tell every other rank where this one gave up; say who arrived, who waits elsewhere and
    who was not heard from within ``grace`` seconds. The sends and their buffer go to ``kept``."""
    rank, size = comm.Get_rank(), comm.Get_size()
    note = np.frombuffer(f"{n}\n{label}".encode("utf-8"), np.uint8).copy()
    kept.append(note)
    kept.extend(comm.Isend([note, MPI.BYTE], dest=j, tag=_TAG_ROLL_CALL)
                for j in range(size) if j != rank)
    heard: Dict[int, Tuple[int, str]] = {}
    status, end = MPI.Status(), time.monotonic() + grace
    while True:
        for j in range(size):
            if j == rank or j in heard or not comm.Iprobe(source=j, tag=_TAG_ROLL_CALL,
                                                          status=status):
                continue
            buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
            comm.Recv([buf, MPI.BYTE], source=j, tag=_TAG_ROLL_CALL)
            count, _, where = buf.tobytes().decode("utf-8", "replace").partition("\n")
            heard[j] = (int(count) if count.isdigit() else -1, where)
        if len(heard) == size - 1 or time.monotonic() >= end:
            break
        time.sleep(0.01)
    return roll_call_verdict(rank, size, heard, n, label)


# ---- the collectives ---------------------------------------------------------------------------

def _int_counts(what: str, counts: np.ndarray) -> None:
    """Refuse counts or displacements past MPI's int32 limit (the same on every rank, since every
    rank computes them from the same agreed numbers)."""
    if counts.size and (int(counts.max()) > _INT_MAX or int(counts.sum()) > _INT_MAX):
        raise ValueError(f"{what}: {int(counts.sum())} elements in one call exceed MPI's int32 "
                         f"count limit; split the tensor into smaller calls")


class _Both:
    """Two MPI requests polled as one (a send and a receive)."""

    def __init__(self, reqs: List[Any]) -> None:
        self.reqs = reqs

    def Test(self) -> bool:
        return bool(MPI.Request.Testall(self.reqs))


class MpiCollectives(ApiCollectives):
    """The tensor API's collectives on one mpi4py intracommunicator, each waiting at most the
    deadline of :meth:`watch` (None or <= 0: no limit). The runtime makes one per job
    communicator; keep one instance per communicator, since the roll call counts its calls."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.calls = 0   # collectives made on the communicator: the roll call compares them
        # After a timeout: why, and what MPI may still touch (kept alive as long as this is).
        self.retired: Optional[Tuple[str, List[Any]]] = None

    @property
    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        """The number of ranks in the communicator."""
        return self.comm.Get_size()

    def _run(self, call: str, start: Callable[[], Any], *keep: Any) -> None:
        """Start one nonblocking collective and wait for it under the deadline; ``keep`` are the
        buffers it uses, kept alive if the collective has to be abandoned."""
        comm = self.comm
        rank = comm.Get_rank()
        if self.retired is not None:
            raise TransportError(f"rank {rank}: this communicator is unusable after an earlier "
                                 f"timeout ({self.retired[0]}); the job must be restarted")
        self.calls += 1
        n = self.calls
        req = start()
        seconds, label = self.deadline
        if seconds is not None and seconds <= 0:
            seconds = None
        try:
            poll_until(req.Test, rank=rank, seconds=seconds, label=label, op=f"MPI {call}",
                       root_side=True, stalled=lambda: "not every rank has arrived")
        except TransportTimeout:
            what, kept = label or "a collective", [req, *keep]
            try:
                who = _roll_call(comm, n, label, min(ROLL_CALL_S, seconds or ROLL_CALL_S), kept)
            except MPI.Exception as exc:   # e.g. a peer is gone: the timeout is still the news
                who = f"could not ask the other ranks where they are ({exc.Get_error_string()})"
            self.retired = (f"{what} timed out", kept)
            raise TransportTimeout(f"rank {rank}: {what} timed out after {seconds:g} s in MPI "
                                   f"{call} (collective #{n} on this communicator): {who}") from None

    @mpi_errors("Allreduce")
    def allreduce_inplace(self, buf: np.ndarray, op: str) -> None:
        """Reduce the contiguous array ``buf`` across the ranks in place with ``op`` (sum/min/max/prod)."""
        if buf.dtype not in _REDUCIBLE:
            raise TypeError(f"MPI cannot reduce dtype {buf.dtype}; cast to float32/float64 or an integer type")
        flat = _flat(buf, "allreduce_inplace")
        for start in range(0, max(flat.size, 1), CHUNK):
            part = flat[start:start + CHUNK]
            self._run("Iallreduce",
                      lambda: self.comm.Iallreduce(MPI.IN_PLACE, part, op=_OPS[op]), part)

    @mpi_errors("Reduce_scatter")
    def reduce_scatter(self, send: np.ndarray, recv: np.ndarray, counts: np.ndarray, op: str) -> None:
        """Reduce ``send`` (every rank's, the same length) elementwise with ``op`` and leave block
        ``r`` (``counts[r]`` elements, blocks in rank order) on rank ``r``, in ``recv``."""
        counts = np.asarray(counts, dtype=np.int64)
        flat = _flat(send, "reduce_scatter")
        out = _flat(recv, "reduce_scatter")
        if flat.dtype not in _REDUCIBLE or out.dtype != flat.dtype:
            raise TypeError(f"reduce_scatter: MPI cannot reduce dtype {flat.dtype} into {out.dtype}")
        rank = self.comm.Get_rank()
        if flat.size != int(counts.sum()) or out.size != int(counts[rank]):
            raise ValueError(f"reduce_scatter: rank {rank} sends {flat.size} and receives "
                             f"{out.size} elements, but the counts say {int(counts.sum())} and "
                             f"{int(counts[rank])}")
        _int_counts("reduce_scatter", counts)
        spec = counts.astype(np.int32)
        self._run("Ireduce_scatter",
                  lambda: self.comm.Ireduce_scatter(flat, out, spec, op=_OPS[op]), flat, out, spec)

    @mpi_errors("Alltoallv")
    def _alltoallv(self, send: np.ndarray, send_counts: np.ndarray, recv: np.ndarray,
                   recv_counts: np.ndarray) -> None:
        """:meth:`alltoallv_bytes` (checked by the base class) in ``Ialltoallv``."""
        _int_counts("alltoallv_bytes", send_counts)
        _int_counts("alltoallv_bytes", recv_counts)
        s_spec = [send, (send_counts.astype(np.int32), _offsets(send_counts).astype(np.int32)), MPI.BYTE]
        r_spec = [recv, (recv_counts.astype(np.int32), _offsets(recv_counts).astype(np.int32)), MPI.BYTE]
        self._run("Ialltoallv", lambda: self.comm.Ialltoallv(s_spec, r_spec), s_spec, r_spec)

    @mpi_errors("Sendrecv")
    def sendrecv_bytes(self, send: np.ndarray, recv: np.ndarray, peer: int) -> None:
        """Swap equal-size contiguous buffers with rank ``peer`` (which calls this with this
        rank as its peer): ``send`` goes out, ``peer``'s arrives in ``recv``."""
        flat = _flat(send, "sendrecv_bytes").view(np.uint8)
        out = _flat(recv, "sendrecv_bytes").view(np.uint8)
        if flat.size != out.size:
            raise ValueError(f"sendrecv_bytes: sends {flat.size} bytes but receives {out.size}")
        for start in range(0, max(flat.size, 1), CHUNK):
            a, b = flat[start:start + CHUNK], out[start:start + CHUNK]
            self._run("Isend/Irecv", lambda: _Both([
                self.comm.Irecv([b, MPI.BYTE], source=peer, tag=_TAG_PAIR),
                self.comm.Isend([a, MPI.BYTE], dest=peer, tag=_TAG_PAIR)]), a, b)

    @mpi_errors("Bcast")
    def bcast_inplace(self, buf: np.ndarray, root: int) -> None:
        """Overwrite the contiguous array ``buf`` on every rank with the root's."""
        flat = _flat(buf, "bcast_inplace").view(np.uint8)
        for start in range(0, max(flat.size, 1), CHUNK):
            part = flat[start:start + CHUNK]
            self._run("Ibcast", lambda: self.comm.Ibcast(part, root=root), part)

    @mpi_errors("Bcast")
    def bcast_bytes(self, payload: Optional[np.ndarray], root: int) -> np.ndarray:
        """Broadcast a variable-size uint8 payload (None off the root): the length, then the bytes."""
        is_root = self.comm.Get_rank() == root
        length = np.array([payload.size if is_root else 0], dtype=np.int64)
        self._run("Ibcast", lambda: self.comm.Ibcast(length, root=root), length)
        if not is_root:   # a length read from another message must not size an allocation
            check_length(self._called("MPI Bcast"), int(length[0]), root, self.comm.Get_rank())
        out = payload if is_root else np.empty(int(length[0]), dtype=np.uint8)
        self.bcast_inplace(out, root)
        return out

    @mpi_errors("Allgather")
    def allgather_int64(self, values: Sequence[int]) -> np.ndarray:
        """Every rank contributes the same number of int64 values; returns a (size, n) array."""
        mine = np.ascontiguousarray(values, dtype=np.int64)
        out = np.empty((self.comm.Get_size(), mine.size), dtype=np.int64)
        self._run("Iallgather", lambda: self.comm.Iallgather(mine, out), mine, out)
        return out

    @mpi_errors("Allgatherv")
    def allgatherv_bytes(self, send: np.ndarray, lengths: np.ndarray,
                         out: Optional[np.ndarray] = None) -> np.ndarray:
        """Concatenate every rank's byte buffer in rank order, into ``out`` (a contiguous uint8
        array of ``sum(lengths)`` bytes, e.g. a view of the result tensor) or a new array.
        ``lengths`` (known to all ranks, e.g. from :meth:`allgather_int64`) gives each rank's
        byte count."""
        rank = self.comm.Get_rank()
        lengths = np.asarray(lengths, dtype=np.int64)
        for j, n in enumerate(lengths):
            check_length(self._called("MPI Allgatherv"), int(n), j, rank)
        check_length(self._called("MPI Allgatherv"), int(lengths.sum()), None, rank)
        flat = _flat(send, "allgatherv_bytes").view(np.uint8)
        if flat.size != lengths[rank]:
            raise ValueError(f"rank {rank}: sends {flat.size} bytes but lengths says {lengths[rank]}")
        total = int(lengths.sum())
        out = np.empty(total, dtype=np.uint8) if out is None else \
            _flat(out, "allgatherv_bytes").view(np.uint8)
        if out.size != total:
            raise ValueError(f"allgatherv_bytes: the output holds {out.size} bytes but the ranks send {total}")
        spec = [out, (lengths, _offsets(lengths)), MPI.BYTE]
        self._run("Iallgatherv", lambda: self.comm.Iallgatherv(flat, spec), flat, spec)
        return out

    @mpi_errors("Barrier")
    def barrier(self) -> None:
        """Block until every rank of the communicator has entered."""
        self._run("Ibarrier", self.comm.Ibarrier)
