"""A process set's groups on one rank, as either backend makes them (runtime/basics.py,
``subgroup``): what ``hvd.add_process_set`` registers (api/process_sets.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional


@dataclass
class SetGroups:
    """The tensor API's collectives among the set's ranks and, made on first use, the
    optimizer's exchange transport among them (both None on a rank outside the set);
    ``release`` frees what was made (called once, on every rank)."""
    api: Optional[Any]
    make_transport: Optional[Callable[[], Any]]
    release: Callable[[], None]


def outside() -> SetGroups:
    """A rank outside the set: nothing to run, nothing to free."""
    return SetGroups(None, None, lambda: None)


def mpi_subgroup(mpi: Any, job: Any, rank: int, ranks: List[int]) -> SetGroups:
    """Collective over the MPI communicator ``job``: the set ``ranks``' communicator (a split)
    and its collectives, and a second one (a Dup) for the optimizer's exchange. ``mpi`` is
    the runtime's communicator utilities (:mod:`hvd_slim.transport.mpi_comm`)."""
    member = rank in ranks
    comm = mpi.split_members(job, member, rank)
    if not member:
        return outside()
    from ..transport.mpi import MpiTransport   # importable: the caller imported mpi4py
    from ..transport.mpi_api import MpiCollectives
    # The exchange's Dup is made now, while every member is here: made later, from the
    # optimizer, it could cross a tensor collective of the set on another rank.
    exchange_comm, made = mpi.dup(comm), []

    def make_transport() -> Any:
        if not made:
            made.append(MpiTransport(exchange_comm))
        return made[0]

    def release() -> None:
        for c in (exchange_comm, comm):
            mpi.free(c)
    return SetGroups(MpiCollectives(comm), make_transport, release)
