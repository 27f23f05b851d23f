"""MPI (mpi4py) transport: the payload collectives of :class:`Transport`, plus the small
communicator and numpy-buffer collectives that the runtime and the public tensor API call.

Everything here works on numpy buffers (the API hands in views that alias tensor memory), so no
torch import is needed. Variable-size collectives exchange int64 lengths first; receive buffers
are allocated once and split into per-rank views, never filled element by element.

The exchange's two collectives are nonblocking and polled against the deadline of
:meth:`Transport.watch`, so a rank that died or hangs ends the step with a
:class:`TransportTimeout` (naming the collective, the step and the missing ranks) instead of a
silent hang. The gather is point-to-point (one matched receive per rank), which is what lets the
root say exactly which ranks never sent.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import numpy as np
from mpi4py import MPI

from .base import (LENGTH_BYTES, Transport, TransportError, TransportTimeout, as_payload,
                   check_bound)
from .deadline import poll_until

F = TypeVar("F", bound=Callable[..., Any])

# Elementwise collectives are split into chunks below MPI's int32 count limit.
_CHUNK = 1 << 30
_OPS = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}
_REDUCIBLE = {np.dtype(t) for t in (np.uint8, np.int8, np.int16, np.int32, np.int64,
                                    np.float32, np.float64)}


def _mpi_errors(op: str) -> Callable[[F], F]:
    """Turn an MPI error into a :class:`TransportError` that names the collective and the rank."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except MPI.Exception as exc:
                rank = MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else -1
                raise TransportError(f"rank {rank}: MPI {op} failed: {exc.Get_error_string()}; "
                                     f"a peer probably died or the ranks called collectives in a "
                                     f"different order") from exc
        return inner  # type: ignore[return-value]
    return wrap


def _check_root(root: int, size: int, what: str) -> None:
    if not isinstance(root, (int, np.integer)) or isinstance(root, bool) or not 0 <= root < size:
        raise ValueError(f"{what}: root {root!r} is not a rank in [0, {size})")


def _flat(buf: np.ndarray, what: str) -> np.ndarray:
    """A 1-D view of ``buf``; refuses non-contiguous arrays, whose reshape would silently copy."""
    if not buf.flags.c_contiguous:
        raise ValueError(f"{what}: the buffer must be C-contiguous so that MPI writes into it in place")
    return buf.reshape(-1)


def _offsets(lengths: np.ndarray) -> np.ndarray:
    displs = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=displs[1:])
    return displs


# Tag of the exchange's point-to-point gather (the exchange communicator is private to it).
_TAG_GATHER = 0x5D1


class MpiTransport(Transport):
    """Payload collectives over one mpi4py intracommunicator (use a dedicated ``Dup`` so other
    traffic on the job communicator cannot interleave with the exchange)."""

    name = "mpi"

    def __init__(self, comm: Any) -> None:
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise TypeError(f"MpiTransport needs an mpi4py intracommunicator, got {type(comm).__name__}")
        super().__init__(comm.Get_rank(), comm.Get_size())
        self.comm = comm
        self._broken: Optional[str] = None

    # --- waiting ------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._broken is not None:
            raise TransportError(f"rank {self.rank}: the exchange transport is unusable after an "
                                 f"earlier failure ({self._broken}); the job must be restarted")

    def _poll(self, done: Callable[[], bool], op: str, root_side: bool,
              stalled: Callable[[], str]) -> None:
        seconds, label = self.deadline
        try:
            poll_until(done, rank=self.rank, seconds=seconds, label=label, op=op,
                       root_side=root_side, stalled=stalled)
        except TransportTimeout as exc:
            # The abandoned request still references this communicator: never reuse it.
            self._broken = str(exc)
            raise

    def _wait(self, req: Any, op: str, root_side: bool, stalled: str) -> None:
        self._poll(req.Test, op, root_side, lambda: stalled)

    # --- the exchange's collectives -----------------------------------------------------------
    @_mpi_errors("gather")
    def gather(self, payload: np.ndarray, root: int, bound: Optional[int] = None
               ) -> Optional[List[np.ndarray]]:
        self._check_usable()
        payload = as_payload(payload)
        check_bound(payload, bound, self.rank, "gather")  # point-to-point needs no padding
        _check_root(root, self.size, "MpiTransport.gather")
        op = f"gather to rank {root}"
        if self.rank != root:
            req = self.comm.Isend([payload, MPI.BYTE], dest=root, tag=_TAG_GATHER)
            self._wait(req, op, False, f"rank {root} did not take this rank's "
                       f"{payload.size}-byte payload (it died, hangs or is elsewhere)")
            self.stats.record("gather", payload.size + LENGTH_BYTES, 0)
            return None
        out: List[Optional[np.ndarray]] = [None] * self.size
        out[root] = payload.copy()
        receiving: Dict[int, Tuple[Any, np.ndarray]] = {}
        pending = set(range(self.size)) - {root}
        status = MPI.Status()

        def done() -> bool:
            for j in sorted(pending):
                if j not in receiving:
                    msg = self.comm.Improbe(source=j, tag=_TAG_GATHER, status=status)
                    if msg is None:
                        continue
                    buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
                    receiving[j] = (msg.Irecv([buf, MPI.BYTE]), buf)
                req, buf = receiving[j]
                if req.Test():
                    out[j] = buf
                    pending.discard(j)
            return not pending

        def stalled() -> str:
            silent = sorted(pending - set(receiving))
            partial = sorted(pending & set(receiving))
            parts = []
            if silent:
                parts.append(f"rank(s) {', '.join(map(str, silent))} sent nothing")
            if partial:
                parts.append(f"rank(s) {', '.join(map(str, partial))} started but did not finish")
            return "; ".join(parts) or "every rank has sent"

        self._poll(done, op, True, stalled)
        total = sum(b.size for b in out)  # type: ignore[union-attr]
        self.stats.record("gather", payload.size + LENGTH_BYTES, total + LENGTH_BYTES * self.size)
        return out  # type: ignore[return-value]

    @_mpi_errors("broadcast")
    def broadcast(self, payload: Optional[np.ndarray], root: int, bound: Optional[int] = None
                  ) -> np.ndarray:
        self._check_usable()
        _check_root(root, self.size, "MpiTransport.broadcast")
        is_root = self.rank == root
        if is_root:
            payload = as_payload(payload)
            check_bound(payload, bound, self.rank, "broadcast")
        op = f"broadcast from rank {root}"
        stalled = (f"rank {root} did not send" if not is_root
                   else "a rank did not take part (it died, hangs or is elsewhere)")
        length = np.array([payload.size if is_root else 0], dtype=np.int64)
        self._wait(self.comm.Ibcast(length, root=root), op, is_root, stalled)
        out = payload if is_root else np.empty(int(length[0]), dtype=np.uint8)
        for lo in range(0, max(out.size, 1), _CHUNK):
            self._wait(self.comm.Ibcast(out[lo:lo + _CHUNK], root=root), op, is_root, stalled)
        n = out.size + LENGTH_BYTES
        self.stats.record("broadcast", n if is_root else 0, n)
        return out


# ---- numpy-buffer collectives used by the public tensor API --------------------------------

@_mpi_errors("Allreduce")
def allreduce_inplace(comm: Any, buf: np.ndarray, op: str) -> None:
    """Reduce the contiguous array ``buf`` across ``comm`` in place with ``op`` (sum/min/max/prod)."""
    if buf.dtype not in _REDUCIBLE:
        raise TypeError(f"MPI cannot reduce dtype {buf.dtype}; cast to float32/float64 or an integer type")
    flat = _flat(buf, "allreduce_inplace")
    for start in range(0, max(flat.size, 1), _CHUNK):
        comm.Allreduce(MPI.IN_PLACE, flat[start:start + _CHUNK], op=_OPS[op])


@_mpi_errors("Bcast")
def bcast_inplace(comm: Any, buf: np.ndarray, root: int) -> None:
    """Overwrite the contiguous array ``buf`` on every rank with the root's."""
    flat = _flat(buf, "bcast_inplace").view(np.uint8)
    for start in range(0, max(flat.size, 1), _CHUNK):
        comm.Bcast(flat[start:start + _CHUNK], root=root)


@_mpi_errors("Bcast")
def bcast_bytes(comm: Any, payload: Optional[np.ndarray], root: int) -> np.ndarray:
    """Broadcast a variable-size uint8 payload (None off the root): the length, then the bytes."""
    is_root = comm.Get_rank() == root
    length = np.array([payload.size if is_root else 0], dtype=np.int64)
    comm.Bcast(length, root=root)
    out = payload if is_root else np.empty(int(length[0]), dtype=np.uint8)
    bcast_inplace(comm, out, root)
    return out


@_mpi_errors("Allgather")
def allgather_int64(comm: Any, values: Sequence[int]) -> np.ndarray:
    """Every rank contributes the same number of int64 values; returns a (size, n) array."""
    mine = np.ascontiguousarray(values, dtype=np.int64)
    out = np.empty((comm.Get_size(), mine.size), dtype=np.int64)
    comm.Allgather(mine, out)
    return out


@_mpi_errors("Allgatherv")
def allgatherv_bytes(comm: Any, send: np.ndarray, lengths: np.ndarray,
                     out: Optional[np.ndarray] = None) -> np.ndarray:
    """Concatenate every rank's byte buffer in rank order, into ``out`` (a contiguous uint8 array
    of ``sum(lengths)`` bytes, e.g. a view of the result tensor) or a new array. ``lengths``
    (known to all ranks, e.g. from :func:`allgather_int64`) gives each rank's byte count."""
    lengths = np.asarray(lengths, dtype=np.int64)
    flat = _flat(send, "allgatherv_bytes").view(np.uint8)
    if flat.size != lengths[comm.Get_rank()]:
        raise ValueError(f"rank {comm.Get_rank()}: sends {flat.size} bytes but lengths says "
                         f"{lengths[comm.Get_rank()]}")
    total = int(lengths.sum())
    out = np.empty(total, dtype=np.uint8) if out is None else _flat(out, "allgatherv_bytes").view(np.uint8)
    if out.size != total:
        raise ValueError(f"allgatherv_bytes: the output holds {out.size} bytes but the ranks send {total}")
    comm.Allgatherv(flat, [out, (lengths, _offsets(lengths)), MPI.BYTE])
    return out


def allgather_bytes(comm: Any, payload: np.ndarray) -> List[np.ndarray]:
    """Every rank's variable-size uint8 payload, in rank order, as views of one buffer."""
    payload = as_payload(payload)
    lengths = allgather_int64(comm, [payload.size])[:, 0]
    return np.split(allgatherv_bytes(comm, payload, lengths), _offsets(lengths)[1:])


@_mpi_errors("Barrier")
def barrier(comm: Any) -> None:
    """Block until every rank of ``comm`` has entered."""
    comm.Barrier()


# ---- communicators, for the runtime --------------------------------------------------------

def world_rank_size() -> Tuple[int, int]:
    """(rank, size) in MPI.COMM_WORLD."""
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def is_communicator(obj: Any) -> bool:
    """True for an mpi4py intracommunicator that is not COMM_NULL."""
    return isinstance(obj, MPI.Intracomm) and obj != MPI.COMM_NULL


@_mpi_errors("Comm_dup")
def dup(comm: Optional[Any] = None) -> Any:
    """A private duplicate of ``comm`` (COMM_WORLD when None); collective over ``comm``."""
    return (MPI.COMM_WORLD if comm is None else comm).Dup()


@_mpi_errors("Comm_create_group")
def sub_comm(ranks: Sequence[int]) -> Any:
    """A communicator over the COMM_WORLD ranks ``ranks``, in that order; collective over those
    ranks only. Raises ValueError on a rank that is not listed."""
    world = MPI.COMM_WORLD
    if world.Get_rank() not in ranks:
        raise ValueError(f"hvd_slim.init(comm={list(ranks)}): this process is COMM_WORLD rank "
                         f"{world.Get_rank()}, which is not in the list; call init() only on the listed ranks")
    group = world.Get_group().Incl(list(ranks))
    try:
        return world.Create_group(group)
    finally:
        group.Free()


@_mpi_errors("Comm_split_type")
def split_shared(comm: Any) -> Any:
    """The ranks of ``comm`` that share this node's memory, ordered by rank in ``comm``."""
    return comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())


@_mpi_errors("Comm_split")
def split(comm: Any, color: int, key: int) -> Any:
    """``comm.Split(color, key)``."""
    return comm.Split(color, key)


def free(comm: Any) -> None:
    """Free a communicator this package created; errors are ignored (shutdown must not fail)."""
    try:
        if MPI.Is_initialized() and not MPI.Is_finalized() and comm != MPI.COMM_NULL:
            comm.Free()
    except MPI.Exception:
        pass


def thread_multiple() -> bool:
    """Whether MPI was initialised with MPI_THREAD_MULTIPLE."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def abort_world(code: int = 1) -> None:
    """End every process of the MPI job (``MPI.COMM_WORLD.Abort``); does not return."""
    MPI.COMM_WORLD.Abort(code)
