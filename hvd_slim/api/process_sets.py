"""Horovod's process sets: :class:`ProcessSet`, ``global_process_set``, the registry of sets
(:func:`register`, :func:`remove`; the public ``add_process_set`` and ``remove_process_set`` run
them on the engine: api/lifecycle.py), and :func:`resolve`, which every collective's
``process_set=`` argument goes through.

A registered set owns a communicator of its own (a ``Split`` of the job communicator; under
torchrun a Gloo group) and the collectives on it (``MpiCollectives``, ``TorchCollectives``), so
a collective inside a set never meets traffic from another set; a second one, made at the same
time, carries the optimizer's exchange inside the set (runtime/basics.py, ``subgroup``). Ranks are the job's ranks, as in Horovod: ``root_rank`` of a
broadcast within a set is a job rank, translated here to the set's own numbering.

Adding and removing sets is collective over the whole job (every rank calls it, in the same
order, with the same ranks, as Horovod's dynamic process sets require); a list that differs
between ranks is refused on every rank with each rank's list. Unlike Horovod, hvd_slim adds
sets after ``init`` without ``HOROVOD_DYNAMIC_PROCESS_SETS``.
"""
from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import numpy as np

from ..runtime import basics
from ..runtime.groups import SetGroups, outside
from .checks import MismatchError, check_root_rank


@dataclass
class _Entry:
    """A registered set: its job ranks (sorted) and this rank's groups in it (the tensor API's
    collectives and the exchange's transport, None on ranks outside the set)."""
    ranks: List[int]
    groups: SetGroups

    @property
    def api(self) -> Any:
        return self.groups.api


class ProcessSet:
    """A set of ranks that run collectives together, as in Horovod.

    Build one from a list of job ranks (or, for :func:`~hvd_slim.init`'s ``process_sets``, an
    mpi4py communicator), then register it with :func:`add_process_set` or ``init``; pass it
    as ``process_set=`` to a collective or to ``DistributedOptimizer``.

    Args:
        ranks_or_comm: A sequence of distinct int job ranks, or an mpi4py intracommunicator
            (on ranks outside it, ``MPI.COMM_NULL``).

    Raises:
        ValueError: an entry is not an int, or the argument is neither ranks nor a communicator.
    """

    def __init__(self, ranks_or_comm: Union[Sequence[int], Any]) -> None:
        self.process_set_id: Optional[int] = None
        self.mpi_comm: Any = None
        self.ranks: Optional[List[int]] = None
        if isinstance(ranks_or_comm, (list, tuple, range, set, frozenset, np.ndarray)):
            ranks = list(ranks_or_comm)
            bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, (int, np.integer))]
            if bad:
                raise ValueError(f"ProcessSet: ranks must be ints, got {bad!r}; pass a list of job "
                                 f"ranks or an mpi4py communicator")
            self.ranks = sorted(int(r) for r in ranks)
        elif type(ranks_or_comm).__module__.startswith("mpi4py"):
            self.mpi_comm = ranks_or_comm
        else:
            raise ValueError(f"ProcessSet: expected a list of job ranks or an mpi4py communicator, "
                             f"got {type(ranks_or_comm).__name__}")

    def size(self) -> Optional[int]:
        """The number of ranks in the set.

        Returns:
            The number of ranks, or None while the set is not registered.
        """
        return None if self.process_set_id is None else len(_entry(self).ranks)

    def rank(self) -> Optional[int]:
        """This rank's position in the set (the rank within its collectives' results).
        Collectives still take job ranks (``root_rank``).

        Returns:
            The position, or None while the set is not registered or on a rank outside it.
        """
        if self.process_set_id is None:
            return None
        ranks = _entry(self).ranks
        me = basics.rank()
        return ranks.index(me) if me in ranks else None

    def included(self) -> Optional[bool]:
        """Whether this rank is in the set.

        Returns:
            True or False, or None when its ranks are not known yet (a set built from a
            communicator before ``init`` registered it).
        """
        return None if self.ranks is None else basics.rank() in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _JobSet(ProcessSet):
    """``global_process_set``: every rank of the running job (no ranks before ``init``)."""

    @property   # type: ignore[override]
    def ranks(self) -> Optional[List[int]]:
        return list(range(basics.size())) if basics.is_initialized() else []

    @ranks.setter
    def ranks(self, value: Optional[List[int]]) -> None:
        pass   # set by ProcessSet.__init__ only: the job decides


global_process_set = _JobSet([])
global_process_set.process_set_id = 0
_registry: Dict[int, _Entry] = {}
_ids = itertools.count(1)


def _entry(ps: ProcessSet) -> _Entry:
    if ps.process_set_id == 0:
        return _Entry(list(range(basics.size())), outside())
    entry = _registry.get(ps.process_set_id) if ps.process_set_id is not None else None
    if entry is None:
        raise ValueError(f"{ps!r} is not registered (or was removed); register it with "
                         f"hvd.add_process_set() or hvd.init(process_sets=[...]) first")
    return entry


@dataclass(frozen=True)
class Group:
    """What a collective runs on: its collectives, size, this rank's position and the job ranks."""
    ranks: List[int]
    rank: int
    size: int
    api: Any

    def local_root(self, what: str, root_rank: Any) -> int:
        """A job ``root_rank`` as a position in this group; ValueError outside it."""
        root = check_root_rank(what, root_rank, basics.size())
        if root not in self.ranks:
            raise ValueError(f"{what}: root_rank={root} is not in the process set (ranks "
                             f"{self.ranks}); pass one of its ranks")
        return self.ranks.index(root)


def resolve(what: str, process_set: Any) -> Group:
    """The group a collective named ``what`` runs on, for its ``process_set`` argument
    (None or ``global_process_set``: the whole job). Starts hvd_slim inside an initialised
    Horovod (collective). Raises ValueError for an unregistered set or one without this rank."""
    if process_set is None or process_set is global_process_set or \
            (isinstance(process_set, ProcessSet) and process_set.process_set_id == 0):
        api = basics.job_collectives()
        return Group(list(range(basics.size())), basics.rank(), basics.size(), api)
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"{what}: process_set must be an hvd.ProcessSet (or None for every rank), "
                         f"got {type(process_set).__name__}")
    entry = _entry(process_set)
    me = basics.rank()
    if entry.api is None:
        raise ValueError(f"{what}: rank {me} is not in {process_set!r}; call it only on the "
                         f"set's ranks")
    return Group(entry.ranks, entry.ranks.index(me), len(entry.ranks), entry.api)


def register(ranks: List[int], what: str) -> int:
    """Collective over the job: check ``ranks`` on every rank, make its groups."""
    api = basics.job_collectives()
    size = basics.size()
    problems = []
    if len(set(ranks)) != len(ranks):
        problems.append(f"rank(s) {sorted({r for r in ranks if ranks.count(r) > 1})} listed twice")
    if any(not 0 <= r < size for r in ranks):
        problems.append(f"rank(s) {[r for r in ranks if not 0 <= r < size]} out of range [0, {size})")
    if not ranks:
        problems.append("no ranks (hvd.global_process_set is the set of every rank)")
    text = repr(ranks).encode()
    rows = api.allgather_int64([zlib.crc32(text), len(ranks), int(bool(problems))])
    if (rows[:, :2] != rows[0, :2]).any():
        lists = api.allgather_bytes(np.frombuffer(text, np.uint8))
        listing = "; ".join(f"rank {r}: {b.tobytes().decode()}" for r, b in enumerate(lists))
        raise MismatchError(f"{what}: the ranks passed different process sets ({listing}); every "
                            f"rank must add the same set, in the same order")
    if problems:
        raise ValueError(f"{what}({ranks}): " + "; ".join(problems))
    if any(e.ranks == ranks for e in _registry.values()):
        raise ValueError(f"{what}: a process set with ranks {ranks} exists already; reuse it")
    ps_id = next(_ids)
    _registry[ps_id] = _Entry(ranks, basics.subgroup(ranks, ps_id))
    return ps_id


def remove(process_set: ProcessSet, barrier: Callable[[], None]) -> bool:
    """Unregister ``process_set``: forget it, wait in ``barrier`` (so no rank frees the set
    while another still uses it), free its communicators. False when it was not registered."""
    entry = _registry.pop(process_set.process_set_id, None)
    process_set.process_set_id = None
    if entry is None:
        return False
    barrier()
    entry.groups.release()
    return True


def members(process_set: ProcessSet) -> List[int]:
    """The job ranks of a registered set (every rank knows them, members or not); ValueError
    for a set that is not registered."""
    return list(_entry(process_set).ranks)


def exchange_transport(process_set: ProcessSet) -> Any:
    """The transport of ``DistributedOptimizer``'s exchange inside ``process_set`` (MPI, or
    Gloo under torchrun): on the set's own exchange communicator or group, so it never meets
    the set's tensor collectives nor any traffic outside the set. Cached per set (every
    optimizer on the set shares it, as optimizers of the whole job share
    :func:`basics.world_transport`); communicates nothing. Raises ValueError on a rank outside
    the set."""
    entry = _entry(process_set)
    if entry.groups.make_transport is None:
        raise ValueError(f"rank {basics.rank()} is not in {process_set!r}: only its ranks run "
                         f"its exchange")
    return entry.groups.make_transport()



def clear() -> None:
    """``shutdown``: free every set's communicators or groups and forget the sets; registered
    ``ProcessSet`` objects go stale."""
    for entry in _registry.values():
        entry.groups.release()
    _registry.clear()
