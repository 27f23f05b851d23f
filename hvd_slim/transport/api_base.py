"""What the tensor API's two collectives classes share: :class:`ApiCollectives`, the base of
:class:`~hvd_slim.transport.mpi_api.MpiCollectives` (mpi4py) and
:class:`~hvd_slim.transport.torch_api.TorchCollectives` (torch.distributed's Gloo), and the
checks both make on the numpy buffers the API hands them.

Both classes offer the same methods on the same buffers (``allreduce_inplace``,
``reduce_scatter``, ``alltoallv_bytes``, ``sendrecv_bytes``, ``bcast_inplace``, ``bcast_bytes``,
``allgather_int64``, ``allgatherv_bytes``, ``allgather_bytes``, ``barrier``), each waiting at
most the deadline of :meth:`~hvd_slim.transport.base.Deadlines.watch`, so the API above them
does not know which one it runs on.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from .base import Deadlines, TransportError, as_payload

ROLL_CALL_S = 5.0   # the most a timed-out rank listens for the others' roll calls
REDUCIBLE = {np.dtype(t) for t in (np.uint8, np.int8, np.int16, np.int32, np.int64,
                                   np.float32, np.float64)}


def flat(buf: np.ndarray, what: str) -> np.ndarray:
    """A 1-D view of ``buf``; refuses non-contiguous arrays, whose reshape would silently copy."""
    if not buf.flags.c_contiguous:
        raise ValueError(f"{what}: the buffer must be C-contiguous so that the collective writes "
                         f"into it in place")
    return buf.reshape(-1)


def offsets(lengths: np.ndarray) -> np.ndarray:
    """Where each rank's block starts, for blocks of ``lengths`` laid end to end."""
    displs = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=displs[1:])
    return displs


def roll_call_verdict(rank: int, size: int, heard: Dict[int, Tuple[int, str]], n: int,
                      label: str) -> str:
    """Who kept collective #``n`` (in ``label``) from completing, from the roll call: ``heard``
    maps each rank heard from to its collective count and the call it waits in. A rank heard
    from with the same count and call arrived too; one heard from elsewhere is named with the
    call it waits in; one not heard from did not arrive."""
    silent = [j for j in range(size) if j != rank and j not in heard]
    parts = [f"rank(s) {', '.join(map(str, silent))} did not arrive"] if silent else []
    parts += [f"rank {j} waits in {where or 'another collective'} (its collective #{count})"
              for j, (count, where) in sorted(heard.items()) if (count, where) != (n, label)]
    return "; ".join(parts) or ("every rank arrived, yet the collective did not complete (did "
                                "the ranks pass different sizes?)")


class ApiCollectives(Deadlines):
    """The tensor API's collectives on one group of ranks; subclasses implement them on a
    library. ``rank`` and ``size`` are this process's place in the group."""

    rank: int
    size: int

    def _called(self, call: str) -> str:
        """``call`` with the public call it serves (the watch label), for error messages."""
        label = self.deadline[1]
        return f"{label} (in {call})" if label else call

    def allgather_int64(self, values: List[int]) -> np.ndarray:   # pragma: no cover - abstract
        raise NotImplementedError

    def allgatherv_bytes(self, send: np.ndarray, lengths: np.ndarray,
                         out: Optional[np.ndarray] = None) -> np.ndarray:   # pragma: no cover
        raise NotImplementedError

    def alltoallv_bytes(self, send: np.ndarray, send_counts: np.ndarray, recv: np.ndarray,
                        recv_counts: np.ndarray) -> None:
        """Send block ``j`` of ``send`` (``send_counts[j]`` bytes, blocks in rank order) to rank
        ``j`` and receive rank ``i``'s block for this rank (``recv_counts[i]`` bytes) into
        ``recv``, in rank order. Both arrays are contiguous uint8 views."""
        send_counts = np.asarray(send_counts, dtype=np.int64)
        recv_counts = np.asarray(recv_counts, dtype=np.int64)
        src = flat(send, "alltoallv_bytes").view(np.uint8)
        out = flat(recv, "alltoallv_bytes").view(np.uint8)
        if src.size != int(send_counts.sum()) or out.size != int(recv_counts.sum()):
            raise ValueError(f"alltoallv_bytes: buffers of {src.size} and {out.size} bytes, but the "
                             f"counts say {int(send_counts.sum())} and {int(recv_counts.sum())}")
        self._alltoallv(src, send_counts, out, recv_counts)

    def _alltoallv(self, send: np.ndarray, send_counts: np.ndarray, recv: np.ndarray,
                   recv_counts: np.ndarray) -> None:   # pragma: no cover - abstract
        """:meth:`alltoallv_bytes` on the library, given the flat uint8 buffers and int64 counts
        it has checked against each other."""
        raise NotImplementedError

    def allgather_bytes(self, payload: np.ndarray, max_bytes: Optional[int] = None) -> List[np.ndarray]:
        """Every rank's variable-size uint8 payload, in rank order, as views of one buffer.
        With ``max_bytes``, a length outside ``[0, max_bytes]`` from any rank (ranks that called
        collectives in different orders) raises TransportError instead of being allocated."""
        payload = as_payload(payload)
        lengths = self.allgather_int64([payload.size])[:, 0]
        if max_bytes is not None and ((lengths < 0) | (lengths > max_bytes)).any():
            raise TransportError(f"rank {self.rank}: the ranks announced payloads of "
                                 f"{lengths.tolist()} bytes where at most {max_bytes} were expected; "
                                 f"they probably called collectives in different orders")
        return np.split(self.allgatherv_bytes(payload, lengths), offsets(lengths)[1:])
