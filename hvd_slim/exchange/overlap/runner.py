"""The communication thread of ``overlap`` (exchange/overlap/staged.py): one per transport, as
Horovod's background loop is one per process.

Every rank must make an exchange transport's collectives in the same order. The main thread
fixes that order: a step is queued (:meth:`Runner.submit`) when its first stage's gradients are
ready, from the gradient hook, so steps are queued in program order on every rank. The thread
runs the queued steps one after another, each stage once it is marked ready, and never reorders
them. Waiting for a step (:meth:`Runner.wait`) first marks every stage of it and of every step
queued before it ready: what the script has not produced by then is zero (an unused parameter),
as in a step without overlap, so a stage that never gets a gradient cannot hang the job.

Anything else that uses the same transport on the main thread (a flat exchange of another
optimizer, a flush) runs inside :func:`exclusive`, after the queue has drained.
"""
from __future__ import annotations

import threading
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional

# A stage: called on the runner's thread once the stage is ready; returns False, or something
# whose ``pulled`` is None (a skipped stage's pending step), to end the step there (every rank
# ends it at the same stage).
Stage = Callable[[], Any]


def ends_step(out: Any) -> bool:
    """Whether a stage's return ends the step (a skip)."""
    return out is False or getattr(out, "pulled", True) is None


class Job:
    """One step's stages, in the order every rank runs them; ``first`` (if any) runs before
    them (the join round). After it ran: ``results`` (each stage's return, in the order run),
    ``outcomes`` (the same by stage index) and ``error`` (the exception that ended it, and the
    stage it came from, -1 for ``first``). ``finished[s]`` is set once stage ``s`` is back (or
    the job ended without it). ``prepared`` holds stages whose local phases ran but whose
    exchange did not (only an ordered job prepares ahead: exchange/overlap/order.py)."""

    def __init__(self, stages: List[Stage], first: Optional[Callable[[], Any]] = None) -> None:
        self.stages, self.first = stages, first
        self.ready = [False] * len(stages)
        self.results: List[Any] = []
        self.outcomes: Dict[int, Any] = {}
        self.prepared: Dict[int, Any] = {}
        self.error: Optional[tuple] = None
        self.done = threading.Event()
        self.finished = [threading.Event() for _ in stages]

    def run(self, wait_ready: Callable[["Job", int], None]) -> None:
        try:
            self._run(wait_ready)
        finally:
            for ev in self.finished:
                ev.set()

    def _run(self, wait_ready: Callable[["Job", int], None]) -> None:
        if not self.run_first():
            return
        for s in range(len(self.stages)):
            wait_ready(self, s)
            if not self.run_stage(s, self.stages[s]):
                return

    def run_first(self) -> bool:
        """The join round; False (the error kept) if it failed."""
        try:
            if self.first is not None:
                self.first()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            self.error = (-1, exc)
            return False
        return True

    def run_stage(self, s: int, stage: Callable[[], Any]) -> bool:
        """Run stage ``s``; False when the step ends there (an error, kept, or a skip)."""
        try:
            out = stage()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            self.error = (s, exc)
            return False
        self.results.append(out)
        self.outcomes[s] = out
        self.finished[s].set()
        return not ends_step(out)


class Runner:
    """The thread of one transport and its queue of steps; ``threaded=False`` runs each step
    on the thread that waits for it (MPI without MPI_THREAD_MULTIPLE)."""

    def __init__(self, threaded: bool, transport: Any = None) -> None:
        # The transport it runs for: runners are found by the transport's id, which a
        # transport made after that one was freed may reuse.
        self.threaded, self.transport = threaded, transport
        self._cv = threading.Condition()
        self._jobs: deque = deque()
        self._thread: Optional[threading.Thread] = None

    def submit(self, job: Job) -> None:
        """Queue ``job`` (stages not ready yet). Inline, nothing runs before :meth:`wait`."""
        if not self.threaded:
            return
        with self._cv:
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="hvd_slim-overlap",
                                                daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def ready(self, job: Job, stage: int) -> None:
        """Stage ``stage`` of ``job`` may run: its gradients are all in."""
        with self._cv:
            job.ready[stage] = True
            self._cv.notify_all()

    def wait(self, job: Job) -> None:
        """Release every stage of ``job`` and of the steps queued before it, then return once
        ``job`` has run (inline: run it here)."""
        if not self.threaded:
            job.ready = [True] * len(job.stages)
            job.run(lambda j, s: None)
            job.done.set()
            return
        self.release(job)
        job.done.wait()

    def release(self, job: Job) -> None:
        """Mark every stage of ``job`` and of the steps queued before it ready (what has no
        gradient by now is zero), without waiting."""
        with self._cv:
            for queued in self._jobs:
                queued.ready = [True] * len(queued.stages)
                if queued is job:
                    break
            self._cv.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Use the transport on this thread: every queued step is released and finished first,
        and none starts meanwhile. A no-op on the runner's own thread."""
        if threading.current_thread() is self._thread or not self.threaded:
            yield
            return
        with self._cv:
            for queued in self._jobs:
                queued.ready = [True] * len(queued.stages)
            self._cv.notify_all()
            self._cv.wait_for(lambda: not self._jobs)
            yield   # the condition's lock is held: the runner cannot pick up a new step

    def _wait_ready(self, job: Job, stage: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: job.ready[stage])

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._jobs))
                job = self._jobs[0]
            try:
                job.run(self._wait_ready)
            finally:
                with self._cv:
                    self._jobs.popleft()
                    self._cv.notify_all()
                job.done.set()


_runners: Dict[int, Runner] = {}
_lock = threading.Lock()


def runner_for(transport: Any, threaded: bool) -> Runner:
    """The runner of ``transport`` (made on first use; kept while the process lives, as the
    transports are)."""
    with _lock:
        runner = _runners.get(id(transport))
        if runner is None or runner.transport is not transport:
            runner = Runner(threaded, transport)
            _runners[id(transport)] = runner
        return runner


@contextmanager
def exclusive(transport: Any) -> Iterator[None]:
    """Around a use of ``transport`` outside its runner (a flat exchange's step or flush): after
    every overlapped step queued on it, and alone."""
    runner = _runners.get(id(transport))
    if runner is None or runner.transport is not transport:
        yield
        return
    with runner.exclusive():
        yield
