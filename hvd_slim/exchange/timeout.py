"""The exchange's deadline: every collective of a step (the handshake, push, pull, a schedule
round, a host's reduction and spread) runs under ``timeout`` seconds, and a rank that waits
longer raises a :class:`~hvd_slim.transport.base.TransportTimeout` that says what to do."""
from __future__ import annotations

from typing import Any, Callable

from ..transport.base import Transport, TransportTimeout
from .errors import TIMEOUT_ADVICE


def watched(transport: Transport, timeout: float, fn: Callable[[], Any], what: str,
            where: str = "") -> Any:
    """``fn()``, whose collectives run over ``transport``, under the exchange timeout; a timeout
    error names ``what`` timed out, ``where`` (how a host's local ranks map to job ranks), and
    what to do."""
    try:
        with transport.watch(timeout, what):
            return fn()
    except TransportTimeout as exc:
        raise TransportTimeout(f"{exc}{where}. {TIMEOUT_ADVICE} (now {timeout:g} s)") from None
