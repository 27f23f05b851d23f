"""MPI (mpi4py) communicators and what every MPI module here shares.

The runtime's communicator utilities (the world's rank and size, ``Dup``, sub-communicators and
splits, ``Free``, the thread level, ``Abort``), :func:`mpi_errors`, which turns an MPI error
into a :class:`TransportError` naming the call, and :data:`CHUNK`, MPI's count limit. The
exchange's transport is :mod:`hvd_slim.transport.mpi`, the tensor API's collectives
:mod:`hvd_slim.transport.mpi_api`.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence, Tuple, TypeVar

from mpi4py import MPI

from .base import TransportError

F = TypeVar("F", bound=Callable[..., Any])

# Elementwise collectives are split into chunks below MPI's int32 count limit.
CHUNK = 1 << 30


def mpi_errors(op: str) -> Callable[[F], F]:
    """Turn an MPI error into a :class:`TransportError` that names the collective and the rank."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except MPI.Exception as exc:
                rank = MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else -1
                raise TransportError(f"rank {rank}: MPI {op} failed: {exc.Get_error_string()}; "
                                     f"a peer probably died or the ranks called collectives in a "
                                     f"different order") from exc
        return inner  # type: ignore[return-value]
    return wrap


# ---- communicators, for the runtime ----------------------------------------------------------

def world_rank_size() -> Tuple[int, int]:
    """(rank, size) in MPI.COMM_WORLD."""
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def is_communicator(obj: Any) -> bool:
    """True for an mpi4py intracommunicator that is not COMM_NULL."""
    return isinstance(obj, MPI.Intracomm) and obj != MPI.COMM_NULL


@mpi_errors("Comm_dup")
def dup(comm: Optional[Any] = None) -> Any:
    """A private duplicate of ``comm`` (COMM_WORLD when None); collective over ``comm``."""
    return (MPI.COMM_WORLD if comm is None else comm).Dup()


@mpi_errors("Comm_create_group")
def sub_comm(ranks: Sequence[int]) -> Any:
    """A communicator over the COMM_WORLD ranks ``ranks``, in that order; collective over those
    ranks only. Raises ValueError on a rank that is not listed."""
    world = MPI.COMM_WORLD
    if world.Get_rank() not in ranks:
        raise ValueError(f"hvd_slim.init(comm={list(ranks)}): this process is COMM_WORLD rank "
                         f"{world.Get_rank()}, which is not in the list; call init() only on the listed ranks")
    group = world.Get_group().Incl(list(ranks))
    try:
        return world.Create_group(group)
    finally:
        group.Free()


@mpi_errors("Comm_split_type")
def split_shared(comm: Any) -> Any:
    """The ranks of ``comm`` that share this node's memory, ordered by rank in ``comm``."""
    return comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())


@mpi_errors("Comm_split")
def split(comm: Any, color: int, key: int) -> Any:
    """``comm.Split(color, key)``."""
    return comm.Split(color, key)


@mpi_errors("Comm_split")
def split_members(comm: Any, member: bool, key: int) -> Any:
    """The members of ``comm`` (those passing ``member=True``) as a new communicator ordered by
    ``key``; COMM_NULL on the others. Collective over ``comm``."""
    return comm.Split(0 if member else MPI.UNDEFINED, key)


def free(comm: Any) -> None:
    """Free a communicator this package created; errors are ignored (shutdown must not fail)."""
    try:
        if MPI.Is_initialized() and not MPI.Is_finalized() and comm != MPI.COMM_NULL:
            comm.Free()
    except MPI.Exception:
        pass


def thread_multiple() -> bool:
    """Whether MPI was initialised with MPI_THREAD_MULTIPLE."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def abort_world(code: int = 1) -> None:
    """End every process of the MPI job (``MPI.COMM_WORLD.Abort``); does not return."""
    MPI.COMM_WORLD.Abort(code)
