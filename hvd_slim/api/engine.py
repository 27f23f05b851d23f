"""The engine: one background thread per process that runs every tensor-API call, FIFO, on
the job's communicators, as Horovod's background loop does. The optimizer's exchange keeps its
own communicator and the caller's thread.

Why a thread: an ``*_async`` call returns a handle at once and completes while the caller
goes on, so ``poll`` is False until it has, and allreduces queued behind a call that waits for a
late rank are fused into one MPI message (:func:`~.engine_rounds.header`). Synchronous calls go
through the same queue and wait for their turn, so every rank still makes its calls in program
order, as matching by order needs. Every call starts with a header round
(:mod:`.engine_rounds`), which checks the ranks agree and is how ``join`` works.

Interface, for collectives of any module:

* :func:`submit` ``(what, name, process_set, run, sig=None, wait=False)``: queue a call whose
  ``run(jobs, rnd)`` sets ``job.result`` on the engine's thread once the ranks agree; returns
  a handle, or with ``wait=True`` the result (its error raised on the calling thread).
  ``sig`` None: a call checked by name only (``what``'s first words), refused while a rank
  has joined.
* :func:`exclusive` (used by ``collective_ops.on_group``): the calling thread makes the block's
  collectives itself, in the queue's order, the engine's thread waiting meanwhile.
* :func:`done_handle`, :func:`poll`, :func:`synchronize`.
* :func:`register_exchange` and :func:`exchange_round`: a ``DistributedOptimizer`` on the whole
  job gets an id (the same on every rank: optimizers are made in the same order) and starts
  each exchange with a round, in which a joined rank learns to run that exchange with zero
  gradients (``optimizer._serve_joined``; :mod:`hvd_slim.api.join`).

Without MPI_THREAD_MULTIPLE two threads may not use MPI at once, and the optimizer's exchange
runs on the caller's: then there is no thread (under torchrun there always is one: Gloo groups
are independent), each call runs on the caller's thread as it is
submitted (``poll`` is always True, nothing is fused) and ``join`` still serves the others.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional

from ..runtime import basics
from . import timeout as api_timeout
from .engine_queue import Engine, Job
from .engine_rounds import FLUSH, GENERIC, STEP, Round, Sig
from .process_sets import Group, resolve

__all__ = ["Engine", "Job", "get", "stop", "submit", "exclusive", "on_group",
           "register_exchange", "exchange_round", "registered", "done_handle", "poll",
           "synchronize"]


_engine: Optional[Engine] = None
_engine_of: Any = None
_lock = threading.Lock()
# Optimizers whose exchange a joined rank serves, by id; kept across init/shutdown (elastic
# recovery), weakly, so an optimizer the script drops is not kept alive.
_exchanges: Dict[int, Callable[[], Any]] = {}
_exchange_ids = itertools.count()


def get() -> Engine:
    """The running hvd_slim's engine, started on first use (one per ``init``)."""
    global _engine, _engine_of
    state = basics._require_started()
    with _lock:
        if _engine is None or _engine_of is not state:
            _engine, _engine_of = Engine(basics.threads_allowed(), state.api, registered), state
        return _engine


def stop() -> None:
    """``shutdown``: stop the engine, if one runs."""
    global _engine, _engine_of
    with _lock:
        engine, _engine, _engine_of = _engine, None, None
    if engine is not None:
        engine.stop()


def submit(what: str, name: Optional[str], process_set: Any,
           run: Callable[[List[Job], Round], None], sig: Optional[Sig] = None,
           wait: bool = False, nbytes: int = 0, payload: Any = None) -> Any:
    """Queue a call named ``what`` on ``process_set`` (see the module); a handle, or with
    ``wait`` its result. Argument and timeout errors raise here, on the calling thread."""
    call = what.split(" of ")[0].split(" (")[0]
    with api_timeout.operation(what, lambda: resolve(call, process_set).api):
        label, seconds = api_timeout.current()
        group = resolve(call, process_set)
        engine = get()
        job = Job(label, name, group, sig or Sig(GENERIC, call), run, seconds, nbytes=nbytes,
                  payload=payload)
        handle = engine.submit(job)
        return engine.synchronize(handle) if wait else handle


@contextmanager
def exclusive(what: str, group: Group) -> Iterator[None]:
    """Inside an :func:`~.api_timeout.operation` named ``what``: the block's collectives on
    ``group`` run on this thread, in their turn (see the module)."""
    label, seconds = api_timeout.current()
    call = what.split(" of ")[0].split(" (")[0]
    job = Job(label, None, group, Sig(GENERIC, call), lambda jobs, rnd: None, seconds)
    with get().exclusive(job):
        yield


@contextmanager
def on_group(what: str, process_set: Any) -> Iterator[Any]:
    """An :func:`~.api_timeout.operation` named ``what`` whose block makes its collectives on
    ``process_set``'s group (None: every rank) itself, in its turn (:func:`exclusive`); yields
    the group. The set is resolved inside the operation, so a bad ``HVD_SLIM_TIMEOUT`` is
    reported before hvd_slim starts."""
    found: List[Group] = []

    def fetch() -> Any:
        found.append(resolve(what.split(" of ")[0], process_set))
        return found[0].api
    with api_timeout.operation(what, fetch):
        with exclusive(what, found[0]):
            yield found[0]


def register_exchange(optimizer: Any) -> int:
    """Give ``optimizer`` (a ``DistributedOptimizer`` on the whole job) its id; a joined rank
    calls its ``_serve_joined(flush)`` when the others start an exchange of that id."""
    with _lock:
        oid = next(_exchange_ids)
        _exchanges[oid] = weakref.ref(optimizer)
    return oid


def registered(oid: int) -> Any:
    """The optimizer with id ``oid``, or None if it is gone."""
    ref = _exchanges.get(oid)
    return None if ref is None else ref()


def exchange_round(what: str, oid: int, flush: bool, wait: bool = True) -> Any:
    """Collective over the job: the round that starts optimizer ``oid``'s exchange (a flush if
    ``flush``), before its own collectives. A rank that has joined runs that exchange in it;
    ranks that make another call meanwhile all raise one MismatchError. ``wait=False`` queues
    it and returns its handle (:func:`synchronize` it before the exchange's collectives): an
    exchange that starts in backward queues its round there, so that it keeps its place in
    program order among the tensor-API calls the script makes after backward."""
    kind = FLUSH if flush else STEP
    sig = Sig(kind, f"DistributedOptimizer #{oid} {'flush' if flush else 'step'}",
              extra={"optimizer": oid})
    return submit(what, None, None, lambda jobs, rnd: None, sig, wait=wait)


def done_handle(result: Any) -> int:
    return get().done_handle(result)


def poll(handle: int) -> bool:
    return get().poll(handle)


def synchronize(handle: int) -> Any:
    return get().synchronize(handle)
