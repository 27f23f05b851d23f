"""The engine's queue and thread (:class:`Engine`); :mod:`.engine` is its interface and says
how it works.

Only the engine's thread takes calls off the queue; callers only append, so calls that a round
agreed to fuse are still at the head when it pops them. A thread that runs calls itself (the
engine's own, or a caller inside an :meth:`Engine.exclusive` block) runs what it submits at
once, which is how nested calls (a broadcast inside ``broadcast_parameters``) keep their place.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional

from ..transport.base import TransportError, TransportTimeout
from . import timeout as api_timeout
from .engine_rounds import (ALLREDUCE, BARRIER, EXCHANGES, FLUSH, FUSE_BYTES, FUSE_MAX, GENERIC,
                            JOIN, JoinState, Round, Sig, exchange, explain, header, joined_refusal)
from .process_sets import Group

_handles = itertools.count(1)
# The first second look's pause (Round.second_look), doubling at each: LOOKS looks wait about
# a second in all before a barrier against a call with no barrier behind it is a mismatch.
LOOK_PAUSE = 0.001


@dataclass
class Job:
    """One queued call. ``run(jobs, rnd)`` gets this job and those fused with it."""
    label: str
    name: Optional[str]
    group: Group
    sig: Sig
    run: Callable[[List["Job"], Round], None]
    seconds: Optional[float]
    handle: int = field(default_factory=lambda: next(_handles))
    done: threading.Event = field(default_factory=threading.Event)
    ready: threading.Event = field(default_factory=threading.Event)   # done, or granted
    result: Any = None
    error: Optional[BaseException] = None
    nbytes: int = 0        # its payload, for the fusion limit
    payload: Any = None    # what its ``run`` reads


class Engine:
    """The queue, the thread and the handles of one running hvd_slim (see the module)."""

    def __init__(self, threaded: bool, job_api: Any,
                 find_exchange: Callable[[int], Any] = lambda oid: None) -> None:
        self._job_api = job_api                 # the job's own group: where joins count
        self._cv = threading.Condition()
        self._queue: Deque[Job] = collections.deque()
        self._jobs: Dict[int, Job] = {}        # handles not yet synchronized
        self._names: Dict[str, int] = {}       # name -> handle, while that call is pending
        self._inline = threading.local()       # set on threads that run calls themselves
        self._held = 0
        self._stopping = False
        self.joins = JoinState()
        # id -> the optimizer whose exchange starts with a round (api/join.py), or None if gone
        self._find_exchange = find_exchange
        self._thread: Optional[threading.Thread] = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, name="hvd_slim-engine", daemon=True)
            self._thread.start()

    # ---- submitting ----------------------------------------------------------------------

    def submit(self, job: Job) -> int:
        """Queue ``job`` (or run it now on a thread that runs calls itself); its handle."""
        with self._cv:
            if self._stopping:
                raise TransportError(f"{job.label}: hvd_slim is shutting down")
            if job.name is not None and job.name in self._names:
                # Horovod refuses this at enqueue, on the rank that made it; no rank waits on it.
                raise ValueError(f"{job.label}: a call named {job.name!r} is still pending "
                                 f"(handle {self._names[job.name]}); use another name or "
                                 f"synchronize() the first one before reusing its name")
            self._jobs[job.handle] = job
            if job.name is not None:
                self._names[job.name] = job.handle
            if not self._runs_inline():
                self._queue.append(job)
                self._cv.notify_all()
                return job.handle
        self._execute(job, [])
        return job.handle

    def _runs_inline(self) -> bool:
        return self._thread is None or getattr(self._inline, "on", False)

    def done_handle(self, result: Any) -> int:
        """A handle for a result that is already there."""
        job = Job("", None, None, Sig(GENERIC, ""), lambda jobs, rnd: None, None)  # type: ignore[arg-type]
        job.result = result
        job.done.set()
        job.ready.set()
        with self._cv:
            self._jobs[job.handle] = job
        return job.handle

    def poll(self, handle: int) -> bool:
        job = self._jobs.get(handle)
        if job is None:
            raise ValueError(f"poll: unknown handle {handle!r}; it was not returned by an *_async "
                             f"call or was already passed to synchronize()")
        return job.done.is_set()

    def synchronize(self, handle: int) -> Any:
        """Wait for the call, release its handle; its result, or its error raised here."""
        job = self._jobs.get(handle)
        if job is None:
            return None
        job.done.wait()
        with self._cv:
            self._jobs.pop(handle, None)
        if job.error is not None:
            raise job.error
        return job.result

    @contextmanager
    def exclusive(self, job: Job) -> Iterator[None]:
        """Run the block on this thread once ``job`` (a GENERIC call) has had its turn and
        header round; the engine's thread waits until the block ends."""
        if self._runs_inline():
            self._execute(job, [])
            self._jobs.pop(job.handle, None)
            if job.error is not None:
                raise job.error
            yield
            return
        release = threading.Event()

        def grant(jobs: List[Job], rnd: Round) -> None:
            job.ready.set()
            release.wait()

        job.run = grant
        self.submit(job)
        job.ready.wait()
        try:
            if job.done.is_set() and job.error is not None:
                raise job.error
            self._inline.on = True
            yield
        finally:
            self._inline.on = False
            release.set()
            self.synchronize(job.handle)

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Calls submitted in the block wait until it ends (then are fused where they can be);
        for tests that need a known fusion."""
        with self._cv:
            self._held += 1
        try:
            yield
        finally:
            with self._cv:
                self._held -= 1
                self._cv.notify_all()

    def stop(self) -> None:
        """At shutdown: fail the calls not yet started, let the running one end."""
        with self._cv:
            self._stopping = True
            left, self._queue = list(self._queue), collections.deque()
            self._cv.notify_all()
        for job in left:
            self._finish([job], TransportError(f"{job.label}: hvd_slim was shut down before "
                                               f"this call ran"))
        if self._thread is not None and self._thread is not threading.current_thread():
            # Briefly: a call still waiting on a dead peer (elastic recovery shuts down after
            # a failure) must not hold up the shutdown; it fails once its communicator goes.
            self._thread.join(timeout=2.0)

    # ---- running -------------------------------------------------------------------------

    def _loop(self) -> None:
        self._inline.on = True
        while True:
            with self._cv:
                while not self._stopping and (not self._queue or self._held):
                    self._cv.wait()
                if self._stopping:
                    return
                job = self._queue.popleft()
                fusable = self._fusable(job)
                behind = self._barrier_behind(job) is not None
            self._execute(job, fusable, behind)

    def _fusable(self, job: Job) -> List[Job]:
        """The allreduces right behind ``job`` in the queue that could share its message."""
        key, out, total = job.sig.fuse_key(), [], job.nbytes
        if key is None:
            return out
        for other in self._queue:
            total += other.nbytes
            if other.sig.fuse_key() != key or other.group.api is not job.group.api \
                    or len(out) + 1 >= FUSE_MAX or total > FUSE_BYTES:
                break
            out.append(other)
        return out

    def _execute(self, job: Job, fusable: List[Job], behind: bool = False) -> None:
        """Run ``job`` (and what the ranks agree to fuse with it) on this thread; ``behind``:
        a barrier on its group is queued behind it."""
        api, batch, error = job.group.api, [job], None
        try:
            with api.watch(job.seconds, job.label):
                looks, sigs = 0, [j.sig for j in fusable]
                rnd = self.round(job.group, header(job.sig, sigs, behind), job.label)
                while job.sig.kind != JOIN:   # a joining rank meets the others' rounds below
                    if rnd.catch_up():
                        if job.sig.kind != BARRIER:
                            self._barrier_first(job)
                            return   # still pending: it runs after the barrier
                    elif rnd.second_look():
                        # This rank's caller may be about to queue the barrier (a pending rank's
                        # header can go out first): look at the queue again, a little later.
                        looks += 1
                        time.sleep(LOOK_PAUSE * 2 ** (looks - 1))
                        with self._cv:
                            behind = self._barrier_behind(job) is not None
                    else:
                        break
                    rnd = self.round(job.group, header(job.sig, sigs, behind, looks), job.label)
                if job.sig.kind == JOIN:
                    job.result = self._serve_joined(job, rnd)
                elif not rnd.agreed():
                    raise explain(api, rnd, job.sig, job.label)
                elif rnd.joined and job.sig.kind not in (ALLREDUCE, BARRIER, *EXCHANGES):
                    raise joined_refusal(rnd, job.label)
                else:
                    if job.sig.kind == ALLREDUCE and rnd.fused() > 1:
                        batch += fusable[:rnd.fused() - 1]
                        with self._cv:   # only this thread takes jobs off the queue
                            for _ in batch[1:]:
                                self._queue.popleft()
                    job.run(batch, rnd)
        except TransportTimeout as exc:
            error = api_timeout.advise(exc, job.seconds)
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            error = exc
        self._finish(batch, error)

    def _barrier_behind(self, job: Job) -> Optional[Job]:
        """The first barrier on ``job``'s group queued behind it (call with the lock held)."""
        return next((j for j in self._queue if j.sig.kind == BARRIER
                     and j.group.api is job.group.api), None)

    def _barrier_first(self, job: Job) -> None:
        """Put ``job`` back at the head of the queue, behind its group's first queued barrier."""
        with self._cv:
            barrier = self._barrier_behind(job)
            self._queue.remove(barrier)
            self._queue.appendleft(job)
            self._queue.appendleft(barrier)

    def round(self, group: Group, row: Any, what: str) -> Round:
        """One header round on ``group``; the job's own group also records who joined."""
        rnd = exchange(group.api, row, what)
        if group.api is self._job_api:
            rnd.last_joined = self.joins.observe(rnd)   # type: ignore[attr-defined]
        return rnd

    def _serve_joined(self, job: Job, rnd: Round) -> Any:
        """``join``: take part in the others' rounds until every rank has joined; the last
        rank to join and the ids of the optimizers served meanwhile."""
        api = job.group.api
        while getattr(rnd, "last_joined", None) is None:
            if rnd.catch_up() or rnd.second_look():
                pass   # the others reorder their queues (or look again) and meet again
            elif not rnd.agreed():
                explain(api, rnd, job.sig, job.label)   # collective; the others raise it
            elif rnd.kind() == ALLREDUCE and rnd.zeros() is not None:
                zeros, op = rnd.zeros()   # type: ignore[misc]
                api.allreduce_inplace(zeros.numpy(), op)
            elif rnd.kind() in EXCHANGES:
                self._serve_exchange(rnd, job.label)
            rnd = self.round(job.group, header(job.sig), job.label)
        return rnd.last_joined   # type: ignore[attr-defined]

    def _serve_exchange(self, rnd: Round, what: str) -> None:
        """Run, with zero gradients, the exchange the active ranks start (the optimizer's
        own collectives, on its transport)."""
        optimizer = self._find_exchange(rnd.exchange_id())
        if optimizer is None:
            raise TransportError(
                f"{what}: the other ranks step DistributedOptimizer #{rnd.exchange_id()}, which "
                f"this rank does not have (every rank must create the same optimizers in the "
                f"same order)")
        optimizer._serve_joined(flush=rnd.kind() == FLUSH)

    def _finish(self, batch: List[Job], error: Optional[BaseException]) -> None:
        with self._cv:
            for j in batch:
                j.error = j.error or error
                if j.name is not None and self._names.get(j.name) == j.handle:
                    del self._names[j.name]
                j.done.set()
                j.ready.set()
