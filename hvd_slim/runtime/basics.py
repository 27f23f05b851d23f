"""Process-level state in Horovod's shape: :func:`start`/:func:`stop` (under ``hvd.init`` and
``hvd.shutdown``, api/lifecycle.py), rank and size queries (the
build flags are in build_flags.py), and the two objects the rest of the package reaches the
network through, both handed out from here: :func:`job_collectives` (the tensor API's
collectives on the job's communicator or group) and :func:`world_transport` (the optimizer's
MPI exchange, on a communicator of its own).

Two backends (:func:`backend`). Under an MPI launcher (mpirun, horovodrun), ``"mpi"``: mpi4py
is imported (and MPI initialised) only inside :func:`start`, so ``import hvd_slim`` stays cheap
and works on a machine without MPI. Under an ``env://`` launcher (torchrun), ``"torch"``: the
job runs on torch.distributed (runtime/torch_world.py) and MPI is never touched; what only MPI
provides raises :func:`needs_mpi`'s error naming the call.

Inside an initialised Horovod (``horovod.torch``'s ``hvd.init()``) no ``hvd_slim.init()`` is
needed: rank queries answer from Horovod, and the first collective (building a
``DistributedOptimizer``, a broadcast) starts hvd_slim on the same MPI world.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, List, Optional

from . import abort, env, groups, horovod, hosts, torch_world
from .groups import SetGroups
from .hosts import Placement

NOT_INITIALIZED = "hvd_slim has not been initialized; use hvd.init()."


@dataclass
class _State(Placement):   # built with keywords only: Placement's fields come first
    comm: Any            # the job communicator (a private Dup); the tensor API runs on it
    api: Any             # the tensor API's collectives (MpiCollectives, TorchCollectives)
    exchange_comm: Any   # a second Dup reserved for the optimizer's exchange
    local_comm: Any      # (the communicators are None under torchrun)
    cross_comm: Any
    transport: Any = None
    hosts: Any = None   # hosts.host_transports(), made on first use (hierarchical=True)
    world: Any = None   # the TorchWorld under torchrun (backend "torch"), else None


_state: Optional[_State] = None
_lock = threading.Lock()


def _mpi() -> Any:
    """The communicator utilities (:mod:`hvd_slim.transport.mpi_comm`): the runtime's one way
    into MPI, imported on first use, since importing mpi4py initialises MPI."""
    try:
        from ..transport import mpi_comm
    except ImportError as exc:
        raise ImportError(f"hvd_slim needs mpi4py and an MPI library ({exc}); install them, e.g. "
                          f"`apt-get install libopenmpi-dev && pip install mpi4py`") from exc
    return mpi_comm


def _job_comm(mpi: Any, comm: Any) -> Any:
    """Resolve ``init``'s ``comm`` argument to a communicator this package owns."""
    if comm is None:
        return mpi.dup()
    if isinstance(comm, (list, tuple)):
        world_size = mpi.world_rank_size()[1]
        bad = [r for r in comm if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size]
        if not comm or bad or len(set(comm)) != len(comm):
            raise ValueError(f"hvd_slim.init(comm={list(comm)!r}): expected a non-empty list of distinct "
                             f"COMM_WORLD ranks in [0, {world_size})"
                             + (f"; invalid entries: {bad}" if bad else ""))
        sub = mpi.sub_comm(list(comm))
        try:
            return mpi.dup(sub)
        finally:
            mpi.free(sub)
    if mpi.is_communicator(comm):
        return mpi.dup(comm)
    raise TypeError(f"hvd_slim.init(comm=...): expected None, a list of ranks or an mpi4py "
                    f"intracommunicator, got {type(comm).__name__}")


def start(comm: Optional[Any] = None) -> bool:
    """Start MPI (through mpi4py) and the job's communicators on the ranks of ``comm``
    (``hvd_slim.init``'s argument, api/lifecycle.py); False when already started. The
    launcher's rank variables and an initialised Horovod are checked against MPI's view."""
    global _state
    with _lock:
        if _state is not None:
            return False
        if torch_world.launched_by_env():
            _state = _start_torch(comm)
            return True
        # Before MPI starts: under horovodrun --gloo it would come up as a singleton per rank.
        horovod.check_not_gloo_only()
        mpi = _mpi()
        # Installed first so a failure from here on still ends every rank of the job.
        abort.install()
        env.check_against_mpi(*mpi.world_rank_size())
        if comm is None:
            horovod.check_against(*mpi.world_rank_size())
        job = _job_comm(mpi, comm)
        rank, size = job.Get_rank(), job.Get_size()
        if comm is not None:
            horovod.check_against(rank, size, "the communicator given to hvd_slim.init(comm=...)")
        local = hosts.local_comm(mpi, job)   # HVD_SLIM_HOST_KEY, else shared memory
        local_rank, local_size = local.Get_rank(), local.Get_size()
        # Ranks with the same local rank form one cross communicator (one rank per node).
        cross = mpi.split(job, local_rank, rank)
        from ..transport.mpi_api import MpiCollectives  # importable: _mpi() imported mpi4py
        _state = _State(comm=job, api=MpiCollectives(job), exchange_comm=mpi.dup(job),
                        local_comm=local, cross_comm=cross, rank=rank, size=size,
                        local_rank=local_rank, local_size=local_size,
                        cross_rank=cross.Get_rank(), cross_size=cross.Get_size())
        if horovod.initialized_horovod() is not None:
            horovod.register_exit_barrier()
    return True


def _start_torch(comm: Optional[Any]) -> _State:
    """:func:`start` under an ``env://`` launcher: the job on torch.distributed."""
    if comm is not None:
        raise needs_mpi("hvd_slim.init(comm=...)", "a communicator or a list of ranks to run on "
                        "is an MPI communicator; under torchrun every rank of the job takes "
                        "part: call hvd.init() without comm, and use hvd.add_process_set() for "
                        "collectives among some ranks")
    # Installed first so a failure from here on still ends every rank of the job.
    abort.install()
    w = torch_world.start()
    return _State(comm=None, api=w.api, exchange_comm=None, local_comm=None, cross_comm=None,
                  rank=w.rank, size=w.size, local_rank=w.local_rank, local_size=w.local_size,
                  cross_rank=w.cross_rank, cross_size=w.cross_size, world=w)


def stop() -> None:
    """Free the job's communicators and the exchange's transports (``hvd_slim.shutdown``,
    api/lifecycle.py, first stops what runs on them). A no-op when not started."""
    global _state
    with _lock:
        state, _state = _state, None
    if state is None:
        return
    if state.world is not None:
        state.world.close()
        return
    if state.transport is not None:
        state.transport.close()
    mpi = _mpi()
    for t in (state.hosts or (None,))[1:]:   # the hierarchy's transports own their comms
        t.close()
        mpi.free(t.comm)
    for c in (state.exchange_comm, state.cross_comm, state.local_comm, state.comm):
        mpi.free(c)


def is_initialized() -> bool:
    """Whether hvd_slim is running: :func:`init` was called and :func:`shutdown` was not.

    Inside an initialised Horovod it stays False until hvd_slim starts itself (first
    collective or optimizer), though :func:`rank` and :func:`size` already answer.

    Returns:
        True when hvd_slim is initialised, else False.
    """
    return _state is not None


def _require() -> _State:
    state = _state
    if state is None:
        raise ValueError(NOT_INITIALIZED)
    return state


def _require_started() -> _State:
    """The state, first starting hvd_slim from an initialised Horovod. Collective in that case:
    call it only where every rank calls it (collectives, building an optimizer)."""
    if _state is None and horovod.initialized_horovod() is not None:
        start()
    return _require()


def backend() -> str:
    """What the running job's collectives run on.

    Returns:
        ``"mpi"`` (mpi4py, under mpirun or horovodrun) or ``"torch"`` (torch.distributed,
        under torchrun or another ``env://`` launcher).

    Raises:
        ValueError: hvd_slim is not initialised.
    """
    return "mpi" if _require().world is None else "torch"


def needs_mpi(call: str, why: str) -> RuntimeError:
    """The error for ``call``, which only MPI provides, in a job running on torch.distributed;
    ``why`` says what MPI gives it and what to do instead under torchrun."""
    return RuntimeError(f"{call} needs MPI: {why}. This job was started by torchrun (RANK, "
                        f"WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so hvd_slim runs on "
                        f"torch.distributed; launch with mpirun or horovodrun to use it")


def _mpi_only(call: str, why: str) -> _State:
    """The running state, or :func:`needs_mpi`'s error when it runs on torch.distributed."""
    state = _require_started()
    if state.world is not None:
        raise needs_mpi(call, why)
    return state


def threads_allowed() -> bool:
    """Whether the tensor API may run its collectives on a thread of its own while the
    optimizer's exchange runs on the caller's: MPI needs MPI_THREAD_MULTIPLE for that; Gloo
    groups are independent of each other."""
    state = _require_started()
    return True if state.world is not None else bool(_mpi().thread_multiple())


def subgroup(ranks: List[int], set_id: int) -> SetGroups:
    """Collective over the job: the groups of the process set of job ranks ``ranks`` (sorted)
    with id ``set_id`` (the same on every rank): MPI communicators split off the job's, or
    torch.distributed groups (runtime/torch_world.py)."""
    state = _require_started()
    if state.world is not None:
        return state.world.subgroup(ranks, set_id)
    return groups.mpi_subgroup(_mpi(), state.comm, state.rank, ranks)


def _query(attr: str) -> int:
    """A rank/size query; before hvd_slim starts inside Horovod, Horovod answers it (a query
    must never trigger the collective start-up, which would hang if one rank asked alone)."""
    state = _state
    if state is None:
        hvd = horovod.initialized_horovod()
        if hvd is not None:
            return int(getattr(hvd, attr)())
    return getattr(_require(), attr)


def job_comm() -> Any:
    """The job communicator the public tensor API runs its collectives on.

    Collective only when it starts hvd_slim from an initialised Horovod.

    Returns:
        The mpi4py communicator (hvd_slim's private duplicate).

    Raises:
        ValueError: neither hvd_slim nor Horovod is initialised.
        RuntimeError: under torchrun, which has no MPI communicator.
    """
    return _mpi_only("hvd_slim.job_comm()", "it returns hvd_slim's MPI communicator").comm


def job_collectives() -> Any:
    """The :class:`~hvd_slim.transport.mpi_api.MpiCollectives` on :func:`job_comm` (under
    torchrun the :class:`~hvd_slim.transport.torch_api.TorchCollectives` on a Gloo group),
    which the public tensor API is handed (as the exchange is handed its transport).
    Collective only when it starts hvd_slim from an initialised Horovod.

    Returns:
        The job's ``MpiCollectives`` or ``TorchCollectives``.

    Raises:
        ValueError: neither hvd_slim nor Horovod is initialised.
    """
    return _require_started().api


def rank() -> int:
    """This process's rank in the job.

    Before hvd_slim starts inside an initialised Horovod, Horovod answers.

    Returns:
        An int in ``[0, size())``.

    Raises:
        ValueError: neither hvd_slim nor Horovod is initialised.
    """
    return _query("rank")


def size() -> int:
    """Number of processes in the job.

    Before hvd_slim starts inside an initialised Horovod, Horovod answers.

    Returns:
        An int >= 1.

    Raises:
        ValueError: neither hvd_slim nor Horovod is initialised.
    """
    return _query("size")


def local_rank() -> int:
    """Rank among the job's processes on this node (use it to pick a GPU).

    Before hvd_slim starts inside an initialised Horovod, Horovod answers.

    Returns:
        An int in ``[0, local_size())``.

    Raises:
        ValueError: neither hvd_slim nor Horovod is initialised.
    """
    return _query("local_rank")


def local_size() -> int:
    """Number of the job's processes on this node.

    Before hvd_slim starts inside an initialised Horovod, Horovod answers.

    Returns:
        An int >= 1.

    Raises:
        ValueError: neither hvd_slim nor Horovod is initialised.
    """
    return _query("local_size")


def cross_rank() -> int:
    """Rank among the job's processes that share this local rank (normally the node index).

    Before hvd_slim starts inside an initialised Horovod, Horovod answers.

    Returns:
        An int in ``[0, cross_size())``.

    Raises:
        ValueError: neither hvd_slim nor Horovod is initialised.
    """
    return _query("cross_rank")


def cross_size() -> int:
    """Number of processes that share this process's local rank (normally the node count).

    Before hvd_slim starts inside an initialised Horovod, Horovod answers.

    Returns:
        An int >= 1.

    Raises:
        ValueError: neither hvd_slim nor Horovod is initialised.
    """
    return _query("cross_size")


def world_transport() -> Any:
    """The :class:`~hvd_slim.transport.mpi.MpiTransport` for the optimizer's exchange, on a
    communicator of its own so API collectives never interleave with it. Cached; collective only
    when it starts hvd_slim from an initialised Horovod.

    Returns:
        The MPI transport (the same object on every call until :func:`shutdown`).

    Raises:
        ValueError: neither hvd_slim nor Horovod is initialised.
        RuntimeError: under torchrun, where the exchange runs on Gloo or NCCL.
    """
    state = _mpi_only("hvd_slim.world_transport()", "it is the optimizer's MPI transport; "
                      "under torchrun the exchange runs on Gloo or NCCL (transport='gloo' or "
                      "'nccl', or 'auto')")
    if state.transport is None:
        from ..transport.mpi import MpiTransport  # importable: init() imported mpi4py
        state.transport = MpiTransport(state.exchange_comm)
    return state.transport


def host_transports() -> Any:
    """``(hosts, local, cross)`` for ``hierarchical=True``: each rank's host number and the
    exchange's MPI transports among this host's ranks and among this local rank's peers on the
    other hosts (:func:`hvd_slim.runtime.hosts.host_transports`). Cached; collective on first
    call.

    Returns:
        The host numbers (a list by rank) and the two transports.

    Raises:
        ValueError: neither hvd_slim nor Horovod is initialised.
    """
    state = _mpi_only("hierarchical=True over transport='mpi'", "its host and cross-host "
                      "transports are MPI communicators; under torchrun pass transport='gloo' "
                      "or 'nccl'")
    if state.hosts is None:
        state.hosts = hosts.host_transports(_mpi(), state.comm, state.local_comm)
    return state.hosts


def mpi_threads_supported() -> bool:
    """Whether MPI runs with MPI_THREAD_MULTIPLE.

    Returns:
        True when MPI provides MPI_THREAD_MULTIPLE, else False (also under torchrun, where
        no MPI runs, as Horovod answers on Gloo).

    Raises:
        ValueError: hvd_slim is not initialised (an initialised Horovod does not answer).
    """
    if _require().world is not None:
        return False
    return bool(_mpi().thread_multiple())


def mpi_enabled() -> bool:
    """Whether MPI runs the collectives: under mpirun or horovodrun, not under torchrun.

    Returns:
        True once hvd_slim is initialised on MPI, else False.
    """
    state = _state
    return state is not None and state.world is None


__all__: List[str] = [
    "backend", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "mpi_threads_supported", "mpi_enabled", "world_transport", "job_comm",
    "job_collectives", "NOT_INITIALIZED",
]
