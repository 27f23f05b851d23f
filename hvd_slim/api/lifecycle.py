"""Starting and stopping hvd_slim, and registering process sets: Horovod's ``init``,
``shutdown``, ``add_process_set`` and ``remove_process_set``, each collective over the job.

The process runtime (MPI, the job's communicators: runtime/basics.py) starts first and stops
last; the engine and the process sets that run on it (api/engine.py, api/process_sets.py) are
set up after it and torn down before it.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Union

from ..runtime import basics
from ..transport import torch_cache
from . import engine
from . import process_sets as sets
from .timeout import api_timeout


def init(comm: Optional[Any] = None, process_sets: Optional[Any] = None) -> None:
    """Start hvd_slim on the ranks of ``comm``: on MPI (through mpi4py) under mpirun or
    horovodrun, on torch.distributed (Gloo) under torchrun or another ``env://`` launcher.

    Collective over those ranks. Idempotent: later calls before :func:`shutdown` do nothing.
    The launcher's rank variables, and an initialised Horovod, are checked against MPI's view;
    under torchrun every rank registers in the launcher's store first, so a missing or
    duplicated rank is reported on every rank within ``HVD_SLIM_TRANSPORT_TIMEOUT`` seconds.

    Args:
        comm: None (default) for every rank (a Dup of MPI.COMM_WORLD), an mpi4py
            intracommunicator (duplicated), or a non-empty list of distinct COMM_WORLD ranks
            (a sub-communicator, ranked in list order; only the listed ranks call init).
            Under torchrun only None (a communicator is MPI's).
        process_sets: None (default) or ``"dynamic"``, or a list of
            :class:`~hvd_slim.ProcessSet` to register now (each built from job ranks or, on
            its members, an mpi4py communicator); sets can be added later either way.

    Returns:
        None.

    Raises:
        ValueError: a bad ``process_sets`` or rank list (or this rank is not in it), incomplete
            launcher variables, or a bad ``HVD_SLIM_TIMEOUT``.
        TypeError: ``comm`` is neither None, a list of ranks nor a communicator.
        ImportError: mpi4py (or an MPI library) is not installed (under an MPI launcher).
        RuntimeError: the launcher or Horovod disagrees with MPI on rank or size, Horovod
            runs on Gloo without MPI, the ranks did not meet under torchrun, or an MPI-only
            argument is given under torchrun.
    """
    api_timeout()   # a bad HVD_SLIM_TIMEOUT is refused before anything starts
    if not basics.start(comm):
        return
    try:
        _init_sets(process_sets)
    except BaseException:
        shutdown()
        raise


def shutdown() -> None:
    """Release hvd_slim's communicators and transports; :func:`init` may be called again.

    Call it on every rank. Without a running hvd_slim it only closes the torch.distributed
    transports (``transport="gloo"``/``"nccl"``), if any.

    Returns:
        None.
    """
    # torch.distributed transports (transport="gloo"/"nccl") are torn down with the runtime.
    torch_cache.close_all()
    if not basics.is_initialized():
        return
    engine.stop()   # its thread must be done with the communicators first
    sets.clear()
    basics.stop()


def add_process_set(process_set: Union[sets.ProcessSet, Sequence[int]]) -> sets.ProcessSet:
    """Register a process set and return it.

    Collective over every rank of the job, in the same order on each (like Horovod's dynamic
    process sets); hvd_slim needs no ``HOROVOD_DYNAMIC_PROCESS_SETS`` for it.

    Args:
        process_set: A :class:`~hvd_slim.ProcessSet` built from ranks, or a sequence of job ranks.

    Returns:
        The registered :class:`~hvd_slim.ProcessSet` (``process_set_id`` set).

    Raises:
        ValueError: a rank listed twice or out of range, an empty set, a set with those ranks
            already registered, or a ``ProcessSet`` built from a communicator.
        MismatchError: the ranks passed different sets (raised on every rank).
    """
    ps = process_set if isinstance(process_set, sets.ProcessSet) else sets.ProcessSet(process_set)
    if ps.ranks is None:
        raise ValueError("add_process_set: a sets.ProcessSet built from an MPI communicator can only be "
                         "registered by hvd.init(process_sets=[...]); build it from a list of ranks")
    if ps.process_set_id is not None:
        raise ValueError(f"add_process_set: {ps!r} is registered already")
    with engine.on_group("add_process_set", None):
        ps.process_set_id = sets.register(ps.ranks, "add_process_set")
    return ps


def remove_process_set(process_set: sets.ProcessSet) -> bool:
    """Unregister a process set and free its communicator.

    Collective over every rank of the job.

    Args:
        process_set: A registered :class:`~hvd_slim.ProcessSet`.

    Returns:
        True when it was removed; False for ``global_process_set`` or a set not registered.
    """
    if not isinstance(process_set, sets.ProcessSet) or process_set.process_set_id in (None, 0):
        return False
    with engine.on_group("remove_process_set", None) as group:
        return sets.remove(process_set, group.api.barrier)


def _init_sets(process_sets: Any) -> None:
    """``init(process_sets=...)``: register each listed set (None or "dynamic": none)."""
    if process_sets is None or process_sets == "dynamic":
        return
    if not isinstance(process_sets, (list, tuple)) or \
            not all(isinstance(p, sets.ProcessSet) for p in process_sets):
        raise ValueError("hvd_slim.init(process_sets=...): expected a list of hvd.ProcessSet or "
                         "'dynamic'")
    with engine.on_group("init(process_sets=...)", None) as group:
        _init_each(group.api, process_sets)


def _init_each(api: Any, process_sets: List[sets.ProcessSet]) -> None:
    for ps in process_sets:
        if ps.ranks is None:   # from a communicator: its members, by their job rank
            if basics.backend() != "mpi":
                raise basics.needs_mpi("hvd.ProcessSet(communicator)", "an mpi4py communicator "
                                       "names the set's ranks; build the set from a list of job "
                                       "ranks instead")
            member = ps.mpi_comm is not None and basics._mpi().is_communicator(ps.mpi_comm)
            flags = api.allgather_int64([int(member)])[:, 0]
            ps.ranks = [r for r in range(basics.size()) if flags[r]]
        if ps.ranks == sets.global_process_set.ranks:
            ps.process_set_id = 0
        else:
            ps.process_set_id = sets.register(ps.ranks, "init(process_sets=...)")
