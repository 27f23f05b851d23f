"""Horovod's ``start_timeline`` / ``stop_timeline``: a Chrome-trace JSON file (``chrome://tracing``
or Perfetto) of the tensor collectives this process ran between the two calls.

A much smaller timeline than Horovod's: hvd_slim has no background negotiation cycle, so each
collective is recorded as it runs, on rank 0 only (Horovod's coordinator writes the file too).
Every tensor gets a track named as Horovod names it (``allreduce.<name>``, or
``allreduce.noname.<n>`` for an unnamed tensor) holding a zero-length ``NEGOTIATE_<OP>``
span (the cross-rank check is part of the op here) followed by a ``<OP>`` span over the whole
call; with ``mark_cycles`` each collective also starts with a ``CYCLE_START`` instant, since
each eager collective is its own cycle. The Slim-DP exchange of ``DistributedOptimizer`` is not
recorded. The file is written when the timeline stops (``stop_timeline``, a new
``start_timeline`` or the end of the process).
"""
from __future__ import annotations

import atexit
import itertools
import json
import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Union

from ..runtime import basics

__all__ = ["start_timeline", "stop_timeline"]


class _Recording:
    def __init__(self, path: str, mark_cycles: bool) -> None:
        self.path, self.mark_cycles = path, mark_cycles
        self.start_us = time.time_ns() // 1000
        self.events: List[Dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 0,
             "args": {"name": "hvd_slim", "start_time_since_epoch_in_micros": self.start_us}}]
        self.tracks: Dict[str, int] = {}
        self.unnamed = itertools.count(1)

    def now(self) -> int:
        return time.time_ns() // 1000 - self.start_us

    def track(self, label: str) -> int:
        if label not in self.tracks:
            pid = self.tracks[label] = len(self.tracks) + 1
            self.events += [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": label}},
                            {"name": "process_sort_index", "ph": "M", "pid": pid,
                             "args": {"sort_index": pid}}]
        return self.tracks[label]

    def write(self) -> None:
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump(self.events, f, indent=0)


_lock = threading.Lock()
_active: Optional[_Recording] = None


def _finish() -> None:
    global _active
    with _lock:
        done, _active = _active, None
    if done is not None:
        done.write()


atexit.register(_finish)


@contextmanager
def span(what: str) -> Iterator[None]:
    """Record one collective named ``what`` (``"allreduce of 'x'"``, as the API labels its calls)
    while a timeline is active on this rank; otherwise nothing."""
    rec = _active
    if rec is None:
        yield
        return
    call, _, quoted = what.partition(" of ")
    op = call.split(" ")[0].rstrip("_")
    tensor = quoted.strip("'\"") if quoted else f"noname.{next(rec.unnamed)}"
    pid = rec.track(f"{op}.{tensor}")
    phase = op.upper()
    t0 = rec.now()
    if rec.mark_cycles:
        rec.events.append({"name": "CYCLE_START", "ph": "i", "ts": t0, "pid": pid, "s": "g"})
    rec.events += [{"name": f"NEGOTIATE_{phase}", "ph": "B", "ts": t0, "pid": pid},
                   {"ph": "E", "ts": t0, "pid": pid},
                   {"name": phase, "ph": "B", "ts": t0, "pid": pid, "args": {"call": call}}]
    try:
        yield
    finally:
        rec.events.append({"ph": "E", "ts": rec.now(), "pid": pid})


def start_timeline(file_path: Union[str, "os.PathLike[str]"], mark_cycles: bool = False) -> None:
    """Start recording the tensor collectives into a Chrome-trace JSON file at ``file_path``.

    Local (no communication); only rank 0 records and writes, as in Horovod. A timeline that
    is already running is stopped (its file written) first. See :mod:`hvd_slim.api.timeline` for
    what is recorded.

    Args:
        file_path: The file to write (str or path-like); its directory must exist. Written on
            rank 0 when the timeline stops.
        mark_cycles: Whether to add a ``CYCLE_START`` instant before each collective
            (default False).

    Returns:
        None.

    Raises:
        ValueError: hvd_slim is not initialized.
        TypeError: ``file_path`` is not a str or path-like, or ``mark_cycles`` is not a bool.
        OSError: rank 0 cannot write ``file_path``.
    """
    global _active
    if not isinstance(file_path, (str, os.PathLike)):
        raise TypeError(f"start_timeline: file_path must be a str or path-like, got "
                        f"{type(file_path).__name__}")
    if not isinstance(mark_cycles, bool):
        raise TypeError(f"start_timeline: mark_cycles must be a bool, got {type(mark_cycles).__name__}")
    if not basics.is_initialized():
        raise ValueError("start_timeline: Horovod has not been initialized; use hvd.init().")
    _finish()
    if basics.rank() != 0:
        return
    path = os.fspath(file_path)
    with open(path, "w", encoding="utf-8"):   # fail now, not at stop, when it cannot be written
        pass
    with _lock:
        _active = _Recording(path, mark_cycles)


def stop_timeline() -> None:
    """Stop the timeline started by :func:`start_timeline` and write its file (rank 0).

    Local; a no-op when no timeline is running.

    Returns:
        None.

    Raises:
        ValueError: hvd_slim is not initialized.
    """
    if not basics.is_initialized():
        raise ValueError("stop_timeline: Horovod has not been initialized; use hvd.init().")
    _finish()
