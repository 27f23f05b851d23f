"""Elastic state in Horovod's shape: :class:`State` (commit, restore, sync, reset callbacks) and
:class:`ObjectState` (plain Python attributes, kept as deep copies).

A commit is a copy in host memory on every rank; nothing is written to disk. ``sync`` sends the
state of rank 0 of the current communicator, which after a failure is the lowest surviving
COMM_WORLD rank (:mod:`hvd_slim.elastic.recovery` ranks the survivors in COMM_WORLD order).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Iterable, List, Optional

from ..api import functions
from ..runtime import basics


def _default_bcast(obj: Any) -> Any:
    return functions.broadcast_object(obj, 0, name="elastic state")


def _default_rank() -> int:
    return basics.rank()


class State:
    """Tracks in-memory training state across workers; subclass it or use :class:`ObjectState`.

    Args:
        bcast_object: Sends an object from rank 0 to every rank and returns it (default
            :func:`hvd_slim.broadcast_object` from rank 0).
        get_rank: Returns this worker's rank (default :func:`hvd_slim.rank`).
    """

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None) -> None:
        self._bcast_object = bcast_object or _default_bcast
        self._rank = get_rank or _default_rank
        self._reset_callbacks: List[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Add functions to call after every reset (a worker lost, or hosts updated), e.g. to
        rescale the learning rate to the new :func:`hvd_slim.size`.

        Args:
            callbacks: Functions taking no arguments, called in registration order.

        Returns:
            None.
        """
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by :func:`hvd_slim.elastic.run` after hvd_slim was rebuilt on the survivors:
        :meth:`reset`, then the registered callbacks.

        Returns:
            None.
        """
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (:meth:`save`) as the point a failure rolls back to, then
        :meth:`check_host_updates`. Commits copy everything: commit every few batches rather
        than every one, trading lost steps on failure against the copy's cost.

        Returns:
            None.

        Raises:
            HostsUpdatedInterrupt: never from hvd_slim itself (see :meth:`check_host_updates`).
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """A no-op: hvd_slim has no elastic driver to announce added or removed hosts (Horovod
        broadcasts the driver's notifications here and raises :class:`HostsUpdatedInterrupt`).
        Lost workers are found when a collective fails instead.

        Returns:
            None.
        """

    def save(self) -> None:
        """Copy the current state to host memory (the commit).

        Returns:
            None.
        """
        raise NotImplementedError

    def restore(self) -> None:
        """Bring back the last saved state, undoing everything since.

        Returns:
            None.
        """
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's state equal to rank 0's. Collective.

        Returns:
            None.
        """
        raise NotImplementedError

    def reset(self) -> None:
        """Adapt to a new communicator (before :meth:`sync`); the default does nothing.

        Returns:
            None.
        """


class ObjectState(State):
    """State of plain Python objects, each given as a keyword and exposed as an attribute
    (``state.epoch``). Saved as deep copies, so mutating an attribute in place does not change
    the commit; synced with one :func:`hvd_slim.broadcast_object`.

    Args:
        bcast_object: As :class:`State` (default: broadcast from rank 0).
        get_rank: As :class:`State` (default :func:`hvd_slim.rank`).
        **kwargs: The attributes and their initial values (the first commit).
    """

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None, **kwargs: Any) -> None:
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)
        self._saved_state: Dict[str, Any] = copy.deepcopy(kwargs)
        self._set_attrs()

    def save(self) -> None:
        """Deep-copy every tracked attribute as the commit.

        Returns:
            None.
        """
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self) -> None:
        """Set every tracked attribute back to (a copy of) its committed value.

        Returns:
            None.
        """
        self._set_attrs()

    def sync(self) -> None:
        """Replace the commit and the tracked attributes by rank 0's commit (as Horovod: after a
        restore, or right after a commit, that is its current state). Collective.

        Returns:
            None.
        """
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        # Copies, so that an in-place change after restore cannot reach the commit.
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))
