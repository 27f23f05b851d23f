"""The transport interface: the only thing the exchange needs from a network.

A transport moves opaque byte payloads (1-D ``numpy.uint8`` arrays) between the ranks of one
job with two collectives, ``gather`` to a root and ``broadcast`` from it, and counts what it
moved. ``gather_tensor`` and ``broadcast_tensor`` do the same for 1-D uint8 tensors on a device
(the exchange uses them where ``device_payloads(device)`` says so), counted the same way. Everything above it (wire format, selection, residuals) is pure and testable in one
process with :class:`hvd_slim.transport.fake.FakeCluster`.

Byte accounting, identical for every implementation so figures compare across transports:

* ``gather``: every rank (the root too) adds ``len(payload) + LENGTH_BYTES`` to ``bytes_sent``;
  the root adds the sum of that over all ranks to ``bytes_received``.
* ``broadcast``: the root adds ``len(payload) + LENGTH_BYTES`` to ``bytes_sent``; every rank (the
  root too) adds the same to ``bytes_received``.

``LENGTH_BYTES`` is the int64 length word that variable-size collectives need. A transport that
pads payloads to ``bound`` (fixed-size collectives) counts the padded bytes it really moves.

``bound``: the caller may pass an upper limit on every rank's payload length that every rank
computes identically (the exchange knows it from the slice sizes). Transports whose collectives
need equal sizes pad to it instead of exchanging lengths first; others may ignore it.

Deadlines: the caller wraps collectives in ``with transport.watch(seconds, "the push of step
12"):``. A transport that can time out raises :class:`TransportTimeout` when a collective inside
has not completed within ``seconds``, naming the collective, that label and (where it can tell)
the ranks that never arrived. Transports that cannot time out inherit the no-op default. The
watch itself is :class:`Deadlines`, the one timeout mechanism of hvd_slim: the tensor API's MPI
collectives (:class:`~hvd_slim.transport.mpi_api.MpiCollectives`) use it too.
"""
from __future__ import annotations

import abc
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .staging import broadcast_staged, gather_staged

LENGTH_BYTES = 8


@dataclass
class TransportStats:
    """Cumulative counters of one rank's traffic through a transport."""

    bytes_sent: int = 0
    bytes_received: int = 0
    calls: int = 0
    per_op: dict = field(default_factory=dict)

    def record(self, op: str, sent: int, received: int) -> None:
        self.bytes_sent += sent
        self.bytes_received += received
        self.calls += 1
        s, r = self.per_op.get(op, (0, 0))
        self.per_op[op] = (s + sent, r + received)


class HorovodInternalError(RuntimeError):
    """A collective failed (a peer died, timed out, or raised it on purpose), as Horovod's.

    Every communication failure hvd_slim reports is one (:class:`TransportError` and its
    subclasses), so ``except hvd.HorovodInternalError`` works as with Horovod. Inside
    :func:`hvd_slim.elastic.run` it is recoverable: the survivors agree who is alive, rebuild
    hvd_slim on them, restore the last commit and retry. Outside it, it ends the job like any
    other uncaught exception.
    """


class TransportError(HorovodInternalError):
    """A collective failed: a peer died, timed out or sent something unusable."""


class TransportTimeout(TransportError):
    """A collective did not complete within the deadline set by :meth:`Transport.watch`."""


_NO_DEADLINE: Tuple[Optional[float], str] = (None, "")


class Deadlines:
    """The deadline of :meth:`watch` blocks, which an object's collectives read from
    :attr:`deadline` and wait on (:func:`~hvd_slim.transport.deadline.poll_until`).

    Kept per thread: the tensor API may be called from several threads, each under its own
    limit and label; the exchange watches and makes its collectives in one thread."""

    @contextmanager
    def watch(self, seconds: Optional[float], what: str) -> Iterator[None]:
        """Deadline of ``seconds`` (None: none) for each collective inside the block; ``what``
        names the step phase (or the API call) in timeout errors. Nests; restores the outer
        deadline on exit."""
        local = self._deadlines()
        outer = getattr(local, "current", _NO_DEADLINE)
        local.current = (seconds, what)
        try:
            yield
        finally:
            local.current = outer

    @property
    def deadline(self) -> Tuple[Optional[float], str]:
        """``(seconds, label)`` of this thread's innermost :meth:`watch` block, ``(None, "")``
        outside."""
        return getattr(self._deadlines(), "current", _NO_DEADLINE)

    def _deadlines(self) -> threading.local:
        # Made on first use, so that subclasses need not call an __init__ for it.
        try:
            return self.__dict__["_deadline_local"]
        except KeyError:
            return self.__dict__.setdefault("_deadline_local", threading.local())


class Transport(Deadlines, abc.ABC):
    """Moves byte payloads between ``size`` ranks; this instance is rank ``rank``."""

    name = "abstract"

    def __init__(self, rank: int, size: int) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside [0, {size})")
        self.rank = rank
        self.size = size
        self.stats = TransportStats()

    @abc.abstractmethod
    def gather(self, payload: np.ndarray, root: int, bound: Optional[int] = None
               ) -> Optional[List[np.ndarray]]:
        """Send ``payload`` to ``root``. The root returns every rank's payload in rank order
        (its own included); other ranks return None. Payload sizes may differ by rank; none
        exceeds ``bound`` when it is given."""

    @abc.abstractmethod
    def broadcast(self, payload: Optional[np.ndarray], root: int, bound: Optional[int] = None
                  ) -> np.ndarray:
        """The root sends ``payload``; every rank (the root too) returns the bytes received.
        Non-root ranks pass None. The payload does not exceed ``bound`` when it is given."""

    # --- several roots at once (sharded servers) ---------------------------------------------
    def gather_many(self, payloads: Sequence[np.ndarray], roots: Sequence[int],
                    bounds: Sequence[Optional[int]]) -> Optional[List[np.ndarray]]:
        """Send ``payloads[i]`` to ``roots[i]`` (distinct ranks, the same list on every rank):
        one :meth:`gather` per root, which a transport may run concurrently. A rank that is
        ``roots[i]`` returns every rank's ``payloads[i]`` in rank order; others return None.
        Byte accounting is that of the gathers. The default runs them one after another."""
        _check_roots(roots, self.size, len(payloads), len(bounds))
        return _gather_each(self.gather, payloads, roots, bounds)

    def broadcast_many(self, payload: Optional[np.ndarray], roots: Sequence[int],
                       bounds: Sequence[Optional[int]]) -> List[np.ndarray]:
        """Every root (distinct ranks, the same list on every rank) sends its ``payload``
        (None on other ranks): one :meth:`broadcast` per root, which a transport may run
        concurrently. Every rank returns the roots' payloads in ``roots`` order. Byte
        accounting is that of the broadcasts. The default runs them one after another."""
        _check_roots(roots, self.size, len(roots), len(bounds))
        return [self.broadcast(payload if self.rank == root else None, root, bound)
                for root, bound in zip(roots, bounds)]

    def gather_many_tensor(self, payloads: Sequence[Any], roots: Sequence[int],
                           bounds: Sequence[Optional[int]]) -> Optional[List[Any]]:
        """:meth:`gather_many` for 1-D uint8 tensors (:meth:`gather_tensor` per root)."""
        _check_roots(roots, self.size, len(payloads), len(bounds))
        return _gather_each(self.gather_tensor, payloads, roots, bounds)

    def broadcast_many_tensor(self, payload: Any, roots: Sequence[int],
                              bounds: Sequence[Optional[int]], device: Any = "cpu"
                              ) -> List[Any]:
        """:meth:`broadcast_many` for 1-D uint8 tensors; every rank gets tensors on
        ``device``."""
        _check_roots(roots, self.size, len(roots), len(bounds))
        return [self.broadcast_tensor(payload if self.rank == root else None, root, bound,
                                      device) for root, bound in zip(roots, bounds)]

    # --- device payloads --------------------------------------------------------------------
    def device_payloads(self, device: Any) -> bool:
        """Whether the exchange should hand this transport its messages as uint8 tensors on
        ``device`` (:meth:`gather_tensor`, :meth:`broadcast_tensor`) instead of numpy arrays:
        True where that saves host copies (a GPU's messages, or Gloo's CPU tensors). The
        default is False: numpy, as everything else here."""
        return False

    def gather_tensor(self, payload: Any, root: int, bound: Optional[int] = None
                      ) -> Optional[List[Any]]:
        """:meth:`gather` for a 1-D uint8 tensor; the root gets tensors on ``payload``'s
        device. The default stages through (pinned) host memory; byte accounting is that of
        :meth:`gather`."""
        return gather_staged(self.gather, payload, root, bound)

    def broadcast_tensor(self, payload: Any, root: int, bound: Optional[int] = None,
                         device: Any = "cpu") -> Any:
        """:meth:`broadcast` for a 1-D uint8 tensor (None off the root); every rank gets a
        tensor on ``device``. The default stages through (pinned) host memory."""
        return broadcast_staged(self.broadcast, payload, root, bound, device)

    def threads_allowed(self) -> bool:
        """Whether a thread of the exchange's own may call this transport while the training
        thread calls it too (``overlap``, delayed rounds). The default, True, suits transports
        whose calls are thread-safe; MPI's depends on the thread level it was initialised with."""
        return True

    def close(self) -> None:
        """Release resources; the default has none."""


def _gather_each(gather: Any, payloads: Sequence[Any], roots: Sequence[int],
                 bounds: Sequence[Optional[int]]) -> Optional[List[Any]]:
    """One ``gather(payload, root, bound)`` per root, in order; what this rank received as a
    root (None when it is none of them)."""
    mine = None
    for root, payload, bound in zip(roots, payloads, bounds):
        out = gather(payload, root, bound)
        mine = out if out is not None else mine
    return mine


def _check_roots(roots: Sequence[int], size: int, n_payloads: int, n_bounds: int) -> None:
    """The roots of a many-root collective: distinct ranks, one payload and bound each."""
    roots = list(roots)
    if not roots or len(set(roots)) != len(roots) or \
            any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 0 <= r < size
                for r in roots):
        raise ValueError(f"roots must be distinct ranks in [0, {size}), got {roots}")
    if n_payloads != len(roots) or n_bounds != len(roots):
        raise ValueError(f"{len(roots)} roots need as many payloads and bounds, got "
                         f"{n_payloads} and {n_bounds}")


def check_bound(payload: Any, bound: Optional[int], rank: int, op: str) -> None:
    """A payload over the announced bound is a bug in the caller, never silently truncated."""
    if bound is not None and len(payload) > bound:
        raise ValueError(f"rank {rank}: {op} payload of {len(payload)} bytes exceeds the "
                         f"announced bound of {bound} bytes")


def as_payload(buf: np.ndarray) -> np.ndarray:
    """Check that ``buf`` is a 1-D contiguous uint8 array, the only payload type a transport takes."""
    if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.ndim != 1:
        raise TypeError(f"a transport payload must be a 1-D numpy uint8 array, got {type(buf).__name__}"
                        f"{'' if not isinstance(buf, np.ndarray) else f' of {buf.dtype} with shape {buf.shape}'}")
    return np.ascontiguousarray(buf)
