"""The tensor API's timeout: ``HVD_SLIM_TIMEOUT``, the variable (and default) of the exchange's
``timeout``, also bounds every blocking collective of ``hvd_slim.allreduce``, ``allgather``,
``broadcast``, the object and parameter helpers, ``join`` and ``barrier``.

Every such call runs inside :func:`operation`, handed the runtime's
:func:`~hvd_slim.runtime.basics.job_collectives`, and the limit is set with their ``watch``: the
deadline mechanism every transport has (:class:`~hvd_slim.transport.base.Deadlines`).
A collective that outlives it raises :class:`~hvd_slim.transport.base.TransportTimeout` naming
the call, the ranks that did not arrive (see :mod:`hvd_slim.transport.mpi_api`, and
:mod:`hvd_slim.transport.torch_api` under torchrun) and how to wait longer. Uncaught, that
error ends every rank (:mod:`hvd_slim.runtime.abort`). Caught, the job cannot go on: the
communicator is retired, and at exit the job is ended with MPI Abort (under torchrun, exit
status 1), since MPI cannot finalise with the abandoned collective pending.
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Callable, Iterator, List, Mapping, Optional, Tuple

from ..config import DEFAULT_TIMEOUT, ENV_PREFIX
from ..config.env import resolve_config
from ..runtime import abort
from ..transport.base import TransportTimeout

if TYPE_CHECKING:   # pragma: no cover
    from ..transport.mpi_api import MpiCollectives

TIMEOUT_ENV = ENV_PREFIX + "TIMEOUT"
# Appended to timeout errors: what usually causes one, and how to wait longer.
API_ADVICE = ("A rank died or hangs, or the ranks made different hvd_slim calls (every rank must "
              "call the same collectives in the same order). If a rank legitimately keeps the "
              "others waiting this long (e.g. a rank-0-only evaluation or checkpoint), raise "
              f"{TIMEOUT_ENV} (seconds; 0 waits forever)")

_local = threading.local()


def api_timeout(environ: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """Seconds a tensor-API collective may wait: ``HVD_SLIM_TIMEOUT`` when set (0 or "none":
    forever, returned as None), else the exchange's default. A bad value names the variable."""
    environ = os.environ if environ is None else environ
    raw = environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT
    # The optimizer's own parsing and validation, so both read the variable alike.
    return resolve_config({}, {TIMEOUT_ENV: raw}).timeout


@contextmanager
def operation(what: str, collectives: Optional[Callable[[], "MpiCollectives"]]
              ) -> Iterator[Optional["MpiCollectives"]]:
    """Run the block's collectives under the API timeout and yield what they run on:
    ``collectives()`` (the runtime's :func:`~hvd_slim.runtime.basics.job_collectives`), called
    once the limit is read, so a bad ``HVD_SLIM_TIMEOUT`` is reported before hvd_slim starts.
    None: the block makes no collectives of its own (its nested operations do), and None is
    yielded. ``what`` names the public call in errors (a nested call is named with the
    outermost one, e.g. "broadcast_parameters of 'w', in broadcast_optimizer_state")."""
    stack: List[str] = _local.__dict__.setdefault("stack", [])
    frames: List[Tuple[str, Optional[float]]] = _local.__dict__.setdefault("frames", [])
    label = what if not stack or what.startswith(stack[0]) else f"{what}, in {stack[0]}"
    seconds = api_timeout()
    stack.append(what)
    frames.append((label, seconds))
    try:
        api = None if collectives is None else collectives()
        with nullcontext() if api is None else api.watch(seconds, label):
            yield api
    except TransportTimeout as exc:
        raise advise(exc, seconds) from None
    finally:
        stack.pop()
        frames.pop()


def current() -> Tuple[str, Optional[float]]:
    """``(label, seconds)`` of this thread's innermost :func:`operation`: what the engine's
    thread watches a call under when it runs it for this thread (:mod:`.engine`)."""
    frames = _local.__dict__.get("frames") or [("", api_timeout())]
    return frames[-1]


def advise(exc: TransportTimeout, seconds: Optional[float]) -> TransportTimeout:
    """``exc`` with the advice on what causes a timeout and how to wait longer, once (an error
    already advised comes back as it is); arranges for the job to end should this process
    reach exit, since the abandoned collective stays pending."""
    if getattr(exc, "advised", False):   # a nested operation already explained it
        return exc
    abort.end_job_at_exit(str(exc))
    limit = "no limit" if seconds is None else f"now {seconds:g} s"
    err = TransportTimeout(f"{exc}. {API_ADVICE} ({limit})")
    err.advised = True  # type: ignore[attr-defined]
    return err
