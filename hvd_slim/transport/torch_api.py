"""The public tensor API's collectives over torch.distributed's Gloo: :class:`TorchCollectives`,
the counterpart of :class:`~hvd_slim.transport.mpi_api.MpiCollectives` for a job started by an
``env://`` launcher (torchrun), with the same methods on the same numpy buffers.

Each buffer becomes a tensor over the same memory (``torch.from_numpy``), so Gloo reads and
writes it in place (the API stages CUDA tensors through the host, as over MPI). Where MPI takes
per-rank counts Gloo needs equal sizes: ``allgatherv_bytes`` pads every rank's bytes to the
largest (the lengths are known to every rank) and compacts. ``reduce_scatter`` and
``sendrecv_bytes`` are ``all_to_all_single`` calls (Gloo's own reduce-scatter and point-to-point
work never report completion, so they could not be waited on under a deadline; see each
method). Gloo cannot reduce int16, so int16 is reduced in int32 and
wrapped back, which is exact (sums and products modulo 2**16, minima and maxima as they are).

Deadlines as over MPI: each collective is started asynchronously and polled
(:func:`~hvd_slim.transport.deadline.poll_until`) against :meth:`watch`'s deadline. Who did not
arrive: the roll call goes through the job's key-value store (the launcher's TCPStore) instead
of point-to-point messages: every timed-out rank writes how many collectives it made on this
group and the call it waits in, then reads the others' for a short grace
(:func:`~hvd_slim.transport.api_base.roll_call_verdict` says who is missing). A rank that dies
of an uncaught exception first writes why under ``abort`` (:mod:`hvd_slim.runtime.abort`); a
rank waiting in a collective reads it, so its error names the failed rank even where the
launcher does not end the job at once.

After a timeout or a failure the group is retired (every later call raises at once) and the
abandoned work and its buffers are kept alive with it: Gloo may still write into them.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from .api_base import REDUCIBLE, ROLL_CALL_S, ApiCollectives, flat, offsets, roll_call_verdict
from .base import TransportError, TransportTimeout
from .bounds import check_length
from .deadline import poll_until
from .torch_dist import summary

ABORT_KEY = "abort"     # in the job's store: the first failed rank's message
ABORT_CHECK_S = 0.5     # how often a waiting rank looks for it
_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
        "prod": dist.ReduceOp.PRODUCT}
_WIDENED = {np.dtype(np.int16): np.dtype(np.int32)}   # dtypes Gloo cannot reduce
_REDUCE = {"sum": np.add.reduce, "min": np.minimum.reduce, "max": np.maximum.reduce,
           "prod": np.multiply.reduce}   # reduce_scatter's local step, in rank order


def _tensor(buf: np.ndarray) -> torch.Tensor:
    """A tensor over ``buf``'s memory (a copy only if numpy marks it read-only)."""
    return torch.from_numpy(buf if buf.flags.writeable else buf.copy())


class TorchCollectives(ApiCollectives):
    """The tensor API's collectives on one Gloo process group (``group``, this process being
    ``rank`` of ``size`` in it), each waiting at most the deadline of :meth:`watch` (None or
    <= 0: no limit). ``store`` is the job's key-value store (None: no roll call, no abort
    notes) and ``key`` names this group in it, the same on every rank. Keep one instance per
    group, since the roll call counts its calls."""

    def __init__(self, group: Any, rank: int, size: int, store: Any, key: str) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.store, self.key = store, key
        self.calls = 0
        # After a timeout or failure: why, and what Gloo may still touch.
        self.retired: Optional[Tuple[str, List[Any]]] = None

    # ---- waiting ---------------------------------------------------------------------------

    def _run(self, call: str, start: Callable[[], Any], *keep: Any) -> None:
        """Start one asynchronous collective and wait for it under the deadline; ``keep`` are
        the tensors it uses, kept alive if it has to be abandoned."""
        rank = self.rank
        if self.retired is not None:
            raise TransportError(f"rank {rank}: this process group is unusable after an earlier "
                                 f"failure ({self.retired[0]}); the job must be restarted")
        self.calls += 1
        n = self.calls
        seconds, label = self.deadline
        if seconds is not None and seconds <= 0:
            seconds = None
        what = label or "a collective"
        try:
            work = start()
        except RuntimeError as exc:   # e.g. the group is gone
            raise self._failed(call, what, exc, []) from exc
        next_check = [time.monotonic() + ABORT_CHECK_S]

        def done() -> bool:
            if work.is_completed():
                return True
            now = time.monotonic()
            if now < next_check[0]:
                return False
            next_check[0] = now + ABORT_CHECK_S
            return self._abort_note() is not None
        try:
            poll_until(done, rank=rank, seconds=seconds, label=label, op=f"Gloo {call}",
                       root_side=True, stalled=lambda: "not every rank has arrived")
        except TransportTimeout:
            kept = [work, *keep]
            who = self._roll_call(n, label, min(ROLL_CALL_S, seconds or ROLL_CALL_S))
            self.retired = (f"{what} timed out", kept)
            raise TransportTimeout(f"rank {rank}: {what} timed out after {seconds:g} s in Gloo "
                                   f"{call} (collective #{n} on this group): {who}") from None
        if not work.is_completed():   # a peer failed and said so
            self.retired = (f"{what} was abandoned", [work, *keep])
            raise TransportError(f"rank {rank}: {what} cannot complete in Gloo {call}: "
                                 f"{self._abort_note()}")
        try:
            work.wait()
        except RuntimeError as exc:   # Gloo's errors (a peer's connection closed) are these
            raise self._failed(call, what, exc, [work, *keep]) from exc

    def _failed(self, call: str, what: str, exc: BaseException, kept: List[Any]) -> TransportError:
        """The error of a collective Gloo failed, naming the failed rank where it said why."""
        self.retired = (f"{what} failed", kept)
        note = self._abort_note()
        cause = f"{note} (Gloo: {summary(exc, 200)})" if note else (
            f"{summary(exc)}; a peer probably died or the ranks called collectives in a "
            f"different order")
        return TransportError(f"rank {self.rank}: {what} failed in Gloo {call}: {cause}")

    def _abort_note(self) -> Optional[str]:
        """What the first rank of the job that failed wrote before it ended, if any."""
        if self.store is None:
            return None
        try:
            if self.store.check([ABORT_KEY]):
                return self.store.get(ABORT_KEY).decode("utf-8", "replace")
        except Exception:  # noqa: BLE001 - the store's host may be gone too: nothing to add
            pass
        return None

    def _roll_call(self, n: int, label: str, grace: float) -> str:
        """Write where this rank gave up, read where the others did within ``grace`` s."""
        if self.store is None:
            return "not every rank has arrived (no store to ask the others where they are)"
        prefix = f"roll/{self.key}/"
        heard: Dict[int, Tuple[int, str]] = {}
        try:
            self.store.set(f"{prefix}{self.rank}", f"{n}\n{label}")
            end = time.monotonic() + grace
            while True:
                for j in range(self.size):
                    if j != self.rank and j not in heard and self.store.check([f"{prefix}{j}"]):
                        count, _, where = self.store.get(f"{prefix}{j}").decode(
                            "utf-8", "replace").partition("\n")
                        heard[j] = (int(count) if count.isdigit() else -1, where)
                if len(heard) == self.size - 1 or time.monotonic() >= end:
                    break
                time.sleep(0.05)
        except Exception as exc:  # noqa: BLE001 - the timeout is still the news
            return f"could not ask the other ranks where they are ({summary(exc, 200)})"
        note = self._abort_note()
        verdict = roll_call_verdict(self.rank, self.size, heard, n, label)
        return f"{verdict}; {note}" if note else verdict

    # ---- the collectives -------------------------------------------------------------------

    def allreduce_inplace(self, buf: np.ndarray, op: str) -> None:
        """Reduce the contiguous array ``buf`` across the ranks in place with ``op`` (sum/min/max/prod)."""
        if buf.dtype not in REDUCIBLE:
            raise TypeError(f"Gloo cannot reduce dtype {buf.dtype}; cast to float32/float64 or an "
                            f"integer type")
        data = flat(buf, "allreduce_inplace")
        wide = _WIDENED.get(data.dtype)
        work = data.astype(wide) if wide is not None else data
        t = _tensor(work)
        self._run("all_reduce", lambda: dist.all_reduce(t, op=_OPS[op], group=self.group,
                                                         async_op=True), t)
        if wide is not None:
            data[...] = t.numpy().astype(data.dtype)   # wraps modulo 2**16, as int16 arithmetic
        elif t.data_ptr() != data.ctypes.data:   # reduced in a copy (read-only memory)
            data[...] = t.numpy()

    def reduce_scatter(self, send: np.ndarray, recv: np.ndarray, counts: np.ndarray, op: str) -> None:
        """Reduce ``send`` (every rank's, the same length) elementwise with ``op`` and leave block
        ``r`` (``counts[r]`` elements, blocks in rank order) on rank ``r``, in ``recv``.

        One ``all_to_all_single`` brings every rank's block ``r`` to rank ``r``, which reduces
        them in rank order: Gloo's own reduce-scatter cannot be waited on under a deadline (its
        work never reports completion), and this moves no more bytes."""
        counts = np.asarray(counts, dtype=np.int64)
        src, out = flat(send, "reduce_scatter"), flat(recv, "reduce_scatter")
        if src.dtype not in REDUCIBLE or out.dtype != src.dtype:
            raise TypeError(f"reduce_scatter: Gloo cannot reduce dtype {src.dtype} into {out.dtype}")
        if src.size != int(counts.sum()) or out.size != int(counts[self.rank]):
            raise ValueError(f"reduce_scatter: rank {self.rank} sends {src.size} and receives "
                             f"{out.size} elements, but the counts say {int(counts.sum())} and "
                             f"{int(counts[self.rank])}")
        item = src.dtype.itemsize
        blocks = np.empty((self.size, out.size), dtype=src.dtype)
        self.alltoallv_bytes(src.view(np.uint8), counts * item, blocks.reshape(-1).view(np.uint8),
                             np.full(self.size, out.size * item, dtype=np.int64))
        _REDUCE[op](blocks, axis=0, dtype=src.dtype, out=out)

    def _alltoallv(self, send: np.ndarray, send_counts: np.ndarray, recv: np.ndarray,
                   recv_counts: np.ndarray) -> None:
        """:meth:`alltoallv_bytes` (checked by the base class) in one ``all_to_all_single``."""
        t_in, t_out = _tensor(send), _tensor(recv)
        self._run("all_to_all_single", lambda: dist.all_to_all_single(
            t_out, t_in, output_split_sizes=recv_counts.tolist(),
            input_split_sizes=send_counts.tolist(), group=self.group, async_op=True), t_in, t_out)

    def sendrecv_bytes(self, send: np.ndarray, recv: np.ndarray, peer: int) -> None:
        """Swap equal-size contiguous buffers with rank ``peer`` (which calls this with this
        rank as its peer): ``send`` goes out, ``peer``'s arrives in ``recv``.

        Collective over the group, unlike MPI's: every rank swaps with its own peer at the same
        time (as Adasum's levels do), in one ``all_to_all_single`` that carries nothing between
        other pairs. Gloo's point-to-point work cannot be waited on under a deadline."""
        src = flat(send, "sendrecv_bytes").view(np.uint8)
        out = flat(recv, "sendrecv_bytes").view(np.uint8)
        if src.size != out.size:
            raise ValueError(f"sendrecv_bytes: sends {src.size} bytes but receives {out.size}")
        counts = np.zeros(self.size, dtype=np.int64)
        counts[peer] = src.size
        self.alltoallv_bytes(src, counts, out, counts)

    def bcast_inplace(self, buf: np.ndarray, root: int) -> None:
        """Overwrite the contiguous array ``buf`` on every rank with the root's."""
        t = _tensor(flat(buf, "bcast_inplace").view(np.uint8))
        self._run("broadcast", lambda: dist.broadcast(t, group_src=root, group=self.group,
                                                       async_op=True), t)

    def bcast_bytes(self, payload: Optional[np.ndarray], root: int) -> np.ndarray:
        """Broadcast a variable-size uint8 payload (None off the root): the length, then the bytes."""
        is_root = self.rank == root
        length = np.array([payload.size if is_root else 0], dtype=np.int64)
        self.bcast_inplace(length, root)
        if not is_root:   # a length read from another message must not size an allocation
            check_length(self._called("Gloo broadcast"), int(length[0]), root, self.rank)
        out = payload if is_root else np.empty(int(length[0]), dtype=np.uint8)
        if out.size:
            self.bcast_inplace(out, root)
        return out

    def allgather_int64(self, values: Sequence[int]) -> np.ndarray:
        """Every rank contributes the same number of int64 values; returns a (size, n) array."""
        mine = torch.tensor(np.ascontiguousarray(values, dtype=np.int64))
        out = torch.empty((self.size, mine.numel()), dtype=torch.int64)
        rows = list(out.unbind(0))
        self._run("all_gather", lambda: dist.all_gather(rows, mine, group=self.group,
                                                         async_op=True), mine, out)
        return out.numpy()

    def allgatherv_bytes(self, send: np.ndarray, lengths: np.ndarray,
                         out: Optional[np.ndarray] = None) -> np.ndarray:
        """Concatenate every rank's byte buffer in rank order, into ``out`` (a contiguous uint8
        array of ``sum(lengths)`` bytes, e.g. a view of the result tensor) or a new array.
        ``lengths`` (known to all ranks, e.g. from :meth:`allgather_int64`) gives each rank's
        byte count."""
        lengths = np.asarray(lengths, dtype=np.int64)
        for j, n in enumerate(lengths):
            check_length(self._called("Gloo all_gather"), int(n), j, self.rank)
        check_length(self._called("Gloo all_gather"), int(lengths.sum()), None, self.rank)
        src = flat(send, "allgatherv_bytes").view(np.uint8)
        if src.size != lengths[self.rank]:
            raise ValueError(f"rank {self.rank}: sends {src.size} bytes but lengths says "
                             f"{lengths[self.rank]}")
        total = int(lengths.sum())
        out = np.empty(total, dtype=np.uint8) if out is None else \
            flat(out, "allgatherv_bytes").view(np.uint8)
        if out.size != total:
            raise ValueError(f"allgatherv_bytes: the output holds {out.size} bytes but the ranks "
                             f"send {total}")
        widest = int(lengths.max()) if lengths.size else 0
        if widest == 0:   # every rank knows: nobody sends anything
            return out
        frame = torch.zeros(widest, dtype=torch.uint8)
        frame[:src.size] = torch.from_numpy(src.copy() if not src.flags.writeable else src)
        equal = bool((lengths == widest).all())
        # Equal lengths land in place; otherwise in padded frames, compacted below.
        got = torch.from_numpy(out) if equal else torch.empty(self.size * widest, dtype=torch.uint8)
        rows = list(got.split(widest))
        self._run("all_gather", lambda: dist.all_gather(rows, frame, group=self.group,
                                                         async_op=True), frame, got)
        if not equal:
            frames = got.numpy()
            for j, (start, n) in enumerate(zip(offsets(lengths), lengths)):
                out[start:start + n] = frames[j * widest:j * widest + n]
        return out

    def barrier(self) -> None:
        """Block until every rank of the group has entered."""
        self._run("barrier", lambda: dist.barrier(group=self.group, async_op=True))
