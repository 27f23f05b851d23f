"""An in-process transport with N simulated ranks, one thread each, for single-process tests.

Each rank's exchange runs in its own thread against its own :class:`FakeTransport`; the
collectives meet at a shared barrier. A rank that raises breaks the barrier, so the others get a
:class:`TransportError` instead of waiting forever, and :func:`run_ranks` re-raises the first
failure with its rank. A deadline set with :meth:`Transport.watch` applies to each barrier: the
rank that runs out of time raises :class:`TransportTimeout` naming the ranks that never arrived.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional

import numpy as np

from .base import (LENGTH_BYTES, Transport, TransportError, TransportTimeout, as_payload,
                   check_bound)


class FakeCluster:
    """Shared state of N simulated ranks; hand ``cluster.transport(r)`` to rank r."""

    def __init__(self, size: int, timeout: float = 60.0, device_payloads: bool = False) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self.timeout = timeout
        # Whether ranks take tensor payloads (the exchange's device path) on any device.
        self.device_payloads = device_payloads
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._slots: List[Optional[np.ndarray]] = [None] * size
        # Barriers each rank has entered: every rank enters the same sequence, so on a timeout
        # the ranks behind this one are the ones that never arrived.
        self._entered = [0] * size
        self._aborted = False   # a rank failed (rather than a wait timing out)

    def transport(self, rank: int) -> "FakeTransport":
        return FakeTransport(self, rank)

    def _wait(self, rank: int, what: str, deadline: tuple = (None, "")) -> None:
        seconds, label = deadline
        self._entered[rank] += 1
        mine = self._entered[rank]
        # The cluster's own timeout caps every wait, so a broken test never hangs for long.
        limit = self.timeout if seconds is None else min(seconds, self.timeout)
        try:
            self._barrier.wait(limit)
        except threading.BrokenBarrierError as exc:
            # Broken by whichever waiter timed out first: every waiter reports the timeout.
            missing = [r for r in range(self.size) if self._entered[r] < mine]
            if seconds is not None and seconds <= self.timeout and missing and not self._aborted:
                where = f" in {label}" if label else ""
                raise TransportTimeout(
                    f"rank {rank}: {what}{where} timed out after {seconds:g} s: "
                    f"rank(s) {', '.join(map(str, missing))} never arrived") from exc
            raise TransportError(f"rank {rank}: {what} aborted because a peer failed or timed out "
                                 f"after {self.timeout}s") from exc

    def abort(self) -> None:
        """Break every wait now (a rank failed)."""
        self._aborted = True
        self._barrier.abort()


class FakeTransport(Transport):
    """One simulated rank's endpoint; payloads are copied so no rank aliases another's memory."""

    name = "fake"

    def __init__(self, cluster: FakeCluster, rank: int) -> None:
        super().__init__(rank, cluster.size)
        self._c = cluster

    def gather(self, payload: np.ndarray, root: int, bound: Optional[int] = None
               ) -> Optional[List[np.ndarray]]:
        payload = as_payload(payload)
        check_bound(payload, bound, self.rank, "gather")
        c = self._c
        c._slots[self.rank] = payload.copy()
        c._wait(self.rank, f"gather to rank {root}", self.deadline)
        out = None
        received = 0
        if self.rank == root:
            out = [s.copy() for s in c._slots]
            received = sum(len(s) + LENGTH_BYTES for s in out)
        c._wait(self.rank, f"gather to rank {root}", self.deadline)
        self.stats.record("gather", len(payload) + LENGTH_BYTES, received)
        return out

    def broadcast(self, payload: Optional[np.ndarray], root: int, bound: Optional[int] = None
                  ) -> np.ndarray:
        c = self._c
        if self.rank == root:
            c._slots[root] = as_payload(payload).copy()
            check_bound(c._slots[root], bound, self.rank, "broadcast")
        c._wait(self.rank, f"broadcast from rank {root}", self.deadline)
        out = c._slots[root].copy()
        c._wait(self.rank, f"broadcast from rank {root}", self.deadline)
        n = len(out) + LENGTH_BYTES
        self.stats.record("broadcast", n if self.rank == root else 0, n)
        return out

    # --- device payloads: tensors cloned on their device, never through numpy ----------------
    def device_payloads(self, device: Any) -> bool:
        return self._c.device_payloads

    def gather_tensor(self, payload: Any, root: int, bound: Optional[int] = None
                      ) -> Optional[List[Any]]:
        _check_tensor(payload)
        check_bound(payload, bound, self.rank, "gather")
        c = self._c
        c._slots[self.rank] = payload.clone()
        c._wait(self.rank, f"gather to rank {root}", self.deadline)
        out, received = None, 0
        if self.rank == root:
            out = [s.to(payload.device, copy=True) for s in c._slots]
            received = sum(len(s) + LENGTH_BYTES for s in out)
        c._wait(self.rank, f"gather to rank {root}", self.deadline)
        self.stats.record("gather", len(payload) + LENGTH_BYTES, received)
        return out

    def broadcast_tensor(self, payload: Any, root: int, bound: Optional[int] = None,
                         device: Any = "cpu") -> Any:
        c = self._c
        if self.rank == root:
            _check_tensor(payload)
            check_bound(payload, bound, self.rank, "broadcast")
            c._slots[root] = payload.clone()
        c._wait(self.rank, f"broadcast from rank {root}", self.deadline)
        out = c._slots[root].to(device, copy=True)
        c._wait(self.rank, f"broadcast from rank {root}", self.deadline)
        n = len(out) + LENGTH_BYTES
        self.stats.record("broadcast", n if self.rank == root else 0, n)
        return out


def _check_tensor(payload: Any) -> None:
    import torch
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 \
            or payload.dim() != 1:
        raise TypeError(f"a tensor payload must be a 1-D uint8 tensor, got "
                        f"{type(payload).__name__}")


def run_ranks(size: int, fn: Callable[[int, FakeTransport], Any], timeout: float = 120.0,
              device_payloads: bool = False) -> List[Any]:
    """Run ``fn(rank, transport)`` for every simulated rank in its own thread; return the results
    in rank order, or raise the first rank's exception (naming the rank). ``device_payloads``:
    the transports take tensor payloads, so the exchange runs its device path."""
    cluster = FakeCluster(size, timeout=timeout, device_payloads=device_payloads)
    results: List[Any] = [None] * size
    errors: List[Optional[BaseException]] = [None] * size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, cluster.transport(rank))
        except BaseException as exc:  # noqa: BLE001 - re-raised below with the rank attached
            errors[rank] = exc
            cluster.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            cluster.abort()
            raise TimeoutError(f"simulated rank did not finish within {timeout}s")
    # A peer's TransportError is a consequence; report the rank that failed first on its own.
    primary = [(r, e) for r, e in enumerate(errors) if e is not None and not isinstance(e, TransportError)]
    primary = primary or [(r, e) for r, e in enumerate(errors) if e is not None]
    if primary:
        rank, exc = primary[0]
        raise RuntimeError(f"simulated rank {rank} failed: {type(exc).__name__}: {exc}") from exc
    return results
