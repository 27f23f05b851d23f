"""MPI (mpi4py) transport: the exchange's payload collectives of :class:`Transport`.

Everything here works on numpy buffers, so no torch import is needed (device payloads are in
:mod:`hvd_slim.transport.mpi_device`). The communicators it runs on come from
:mod:`hvd_slim.transport.mpi_comm`; the tensor API's collectives are
:class:`~hvd_slim.transport.mpi_api.MpiCollectives`.

The exchange's two collectives are nonblocking and polled against the deadline of
:meth:`Transport.watch`, so a rank that died or hangs ends the step with a
:class:`TransportTimeout` (naming the collective, the step and the missing ranks) instead of a
silent hang. The gather is point-to-point (one matched receive per rank), which is what lets the
root say exactly which ranks never sent. Its code, and the concurrent many-root collectives
(``gather_many``/``broadcast_many``, for sharded servers), are in
:mod:`hvd_slim.transport.mpi_many`.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from .base import (LENGTH_BYTES, Transport, TransportError, TransportTimeout, _check_roots,
                   as_payload, check_bound)
from .deadline import poll_until
from . import mpi_comm
from .mpi_comm import CHUNK, mpi_errors
from .mpi_many import broadcast_many_buffers, gather_many_buffers

__all__ = ["MpiTransport"]


def _check_root(root: int, size: int, what: str) -> None:
    if not isinstance(root, (int, np.integer)) or isinstance(root, bool) or not 0 <= root < size:
        raise ValueError(f"{what}: root {root!r} is not a rank in [0, {size})")


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

    def threads_allowed(self) -> bool:
        """True only under MPI_THREAD_MULTIPLE: another thread's MPI calls need it."""
        return mpi_comm.thread_multiple()

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
    @mpi_errors("gather")
    def gather(self, payload: np.ndarray, root: int, bound: Optional[int] = None
               ) -> Optional[List[np.ndarray]]:
        payload = as_payload(payload)
        return self.gather_buffers(payload, root, bound, own=payload.copy,
                                   alloc=lambda n: np.empty(n, dtype=np.uint8))

    def gather_buffers(self, payload: Any, root: int, bound: Optional[int],
                       own: Callable[[], Any], alloc: Callable[[int], Any]) -> Optional[List[Any]]:
        """The gather on any 1-D byte buffer mpi4py takes (numpy, or a tensor through DLPack:
        host memory, or device memory with CUDA-aware MPI). ``own()`` is the root's copy of its
        own payload; ``alloc(n)`` makes the buffer a peer's ``n`` bytes are received into."""
        self._check_usable()
        _check_root(root, self.size, "MpiTransport.gather")
        # The one-root case of the concurrent gather: the same messages, checks and counts.
        return gather_many_buffers(self, [payload], [root], [bound], own, alloc)

    @mpi_errors("broadcast")
    def broadcast(self, payload: Optional[np.ndarray], root: int, bound: Optional[int] = None
                  ) -> np.ndarray:
        if self.rank == root:
            payload = as_payload(payload)
        return self.broadcast_buffer(payload, root, bound,
                                     alloc=lambda n: np.empty(n, dtype=np.uint8))

    def broadcast_buffer(self, payload: Any, root: int, bound: Optional[int],
                         alloc: Callable[[int], Any]) -> Any:
        """The broadcast on any 1-D byte buffer mpi4py takes (see :meth:`gather_buffers`);
        ``alloc(n)`` makes the buffer the ``n`` bytes are received into off the root."""
        self._check_usable()
        _check_root(root, self.size, "MpiTransport.broadcast")
        is_root = self.rank == root
        if is_root:
            check_bound(payload, bound, self.rank, "broadcast")
        op = f"broadcast from rank {root}"
        stalled = (f"rank {root} did not send" if not is_root
                   else "a rank did not take part (it died, hangs or is elsewhere)")
        length = np.array([len(payload) if is_root else 0], dtype=np.int64)
        self._wait(self.comm.Ibcast(length, root=root), op, is_root, stalled)
        out = payload if is_root else alloc(int(length[0]))
        for lo in range(0, max(len(out), 1), CHUNK):
            self._wait(self.comm.Ibcast(out[lo:lo + CHUNK], root=root), op, is_root, stalled)
        n = len(out) + LENGTH_BYTES
        self.stats.record("broadcast", n if is_root else 0, n)
        return out

    # --- several roots at once (sharded servers; mpi_many.py) --------------------------------
    @mpi_errors("gather")
    def gather_many(self, payloads: Sequence[np.ndarray], roots: Sequence[int],
                    bounds: Sequence[Optional[int]]) -> Optional[List[np.ndarray]]:
        """Every rank's sends to all roots, and each root's receives, at once (mpi_many.py)."""
        _check_roots(roots, self.size, len(payloads), len(bounds))
        payloads = [as_payload(p) for p in payloads]
        return gather_many_buffers(
            self, payloads, roots, bounds,
            own=lambda: payloads[list(roots).index(self.rank)].copy(),
            alloc=lambda n: np.empty(n, dtype=np.uint8))

    @mpi_errors("broadcast")
    def broadcast_many(self, payload: Optional[np.ndarray], roots: Sequence[int],
                       bounds: Sequence[Optional[int]]) -> List[np.ndarray]:
        """All roots' lengths in one Iallgather, then their data at once (mpi_many.py)."""
        _check_roots(roots, self.size, len(roots), len(bounds))
        if self.rank in roots:
            payload = as_payload(payload)
        return broadcast_many_buffers(self, payload, roots, bounds,
                                      alloc=lambda n: np.empty(n, dtype=np.uint8))

    # --- device payloads (mpi_device.py; torch is imported only when they are used) ---------
    def device_payloads(self, device: Any) -> bool:
        """CUDA tensors travel as tensors: straight from device memory with CUDA-aware MPI,
        else through pinned host buffers. CPU tensors keep the numpy path (as fast, and free)."""
        return getattr(device, "type", str(device).split(":")[0]) == "cuda"

    def gather_tensor(self, payload: Any, root: int, bound: Optional[int] = None
                      ) -> Optional[List[Any]]:
        from .mpi_device import gather_tensor
        return gather_tensor(self, payload, root, bound)

    def broadcast_tensor(self, payload: Any, root: int, bound: Optional[int] = None,
                         device: Any = "cpu") -> Any:
        from .mpi_device import broadcast_tensor
        return broadcast_tensor(self, payload, root, bound, device)

    def gather_many_tensor(self, payloads: Sequence[Any], roots: Sequence[int],
                           bounds: Sequence[Optional[int]]) -> Optional[List[Any]]:
        from .mpi_device import gather_many_tensor
        return gather_many_tensor(self, payloads, roots, bounds)

    def broadcast_many_tensor(self, payload: Any, roots: Sequence[int],
                              bounds: Sequence[Optional[int]], device: Any = "cpu") -> List[Any]:
        from .mpi_device import broadcast_many_tensor
        return broadcast_many_tensor(self, payload, roots, bounds, device)
