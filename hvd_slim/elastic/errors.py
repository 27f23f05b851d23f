"""The two exceptions that drive :func:`hvd_slim.elastic.run`, as Horovod's
(``horovod.common.exceptions``), and which other errors count as the first.

hvd_slim's collectives and exchange report a failed or timed-out communication as
:class:`~hvd_slim.transport.base.TransportError` (:class:`TransportTimeout` a subclass), which
is a :class:`HorovodInternalError`, defined with them.
"""
from __future__ import annotations

from ..api.checks import MismatchError
from ..transport.base import HorovodInternalError, TransportError

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "is_internal"]


class HostsUpdatedInterrupt(RuntimeError):
    """The set of hosts changed: :func:`hvd_slim.elastic.run` syncs and retries without a restore.

    hvd_slim discovers no hosts, so it never raises this itself; user code may (e.g. after
    :meth:`State.commit`) to re-sync every rank from the lowest one.

    Args:
        skip_sync: True to retry without :meth:`State.sync` (Horovod: hosts were only removed).
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__(f"hosts updated (skip_sync={skip_sync})")
        self.skip_sync = skip_sync


def is_internal(exc: BaseException) -> bool:
    """Whether ``exc`` is a communication failure the elastic loop recovers from:
    :class:`HorovodInternalError`, or hvd_slim's :class:`TransportError` (timeouts included),
    raised by the tensor API and the optimizer's exchange alike."""
    # Mismatched arguments are a bug in the script, the same on every retry: not recoverable.
    return isinstance(exc, (HorovodInternalError, TransportError)) and \
        not isinstance(exc, MismatchError)
