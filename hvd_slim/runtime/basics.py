"""Process-level state in Horovod's shape: ``init``/``shutdown``, rank and size queries, build
flags, and the two objects the rest of the package reaches MPI through, both handed out from
here: :func:`job_collectives` (the tensor API's collectives on the job communicator) and
:func:`world_transport` (the optimizer's exchange, on a communicator of its own).

mpi4py is imported (and MPI initialised) only inside :func:`init`, so ``import hvd_slim`` stays
cheap and works on a machine without MPI.

Inside an initialised Horovod (``horovod.torch``'s ``hvd.init()``) no ``hvd_slim.init()`` is
needed: rank queries answer from Horovod, and the first collective (building a
``DistributedOptimizer``, a broadcast) starts hvd_slim on the same MPI world.
"""
from __future__ import annotations

import importlib.util
import sys
import threading
from dataclasses import dataclass
from typing import Any, List, Optional

from . import abort, env, horovod

NOT_INITIALIZED = "hvd_slim has not been initialized; use hvd.init()."


@dataclass
class _State:
    comm: Any            # the job communicator (a private Dup); the tensor API runs on it
    api: Any             # the tensor API's collectives (MpiCollectives) on comm
    exchange_comm: Any   # a second Dup reserved for the optimizer's exchange
    local_comm: Any
    cross_comm: Any
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    transport: Any = None


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


def init(comm: Optional[Any] = None, process_sets: Optional[Any] = None) -> None:
    """Start hvd_slim on ``comm``: None for all ranks (a Dup of MPI.COMM_WORLD), an mpi4py
    communicator (duplicated), or a list of COMM_WORLD ranks (a sub-communicator). Collective
    over those ranks. Idempotent: later calls before :func:`shutdown` do nothing."""
    global _state
    if process_sets is not None:
        raise ValueError("hvd_slim.init(process_sets=...): process sets are not supported; omit the "
                         "argument (every collective runs on all ranks of the job)")
    with _lock:
        if _state is not None:
            return
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
        local = mpi.split_shared(job)
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


def shutdown() -> None:
    """Release hvd_slim's communicators; :func:`init` may be called again afterwards."""
    global _state
    with _lock:
        state, _state = _state, None
    # torch.distributed transports (transport="gloo"/"nccl") are torn down with the runtime.
    torch_dist = sys.modules.get("hvd_slim.transport.torch_dist")
    if torch_dist is not None:
        torch_dist.close_all()
    if state is None:
        return
    if state.transport is not None:
        state.transport.close()
    mpi = _mpi()
    for c in (state.exchange_comm, state.cross_comm, state.local_comm, state.comm):
        mpi.free(c)


def is_initialized() -> bool:
    """Whether :func:`init` has been called (and :func:`shutdown` has not)."""
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
        init()
    return _require()


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
    """The job communicator the public tensor API runs its collectives on."""
    return _require_started().comm


def job_collectives() -> Any:
    """The :class:`~hvd_slim.transport.mpi_api.MpiCollectives` on :func:`job_comm`, which the
    public tensor API is handed (as the exchange is handed :func:`world_transport`). Collective
    only when it starts hvd_slim from an initialised Horovod."""
    return _require_started().api


def rank() -> int:
    """This process's rank in the job, in [0, size())."""
    return _query("rank")


def size() -> int:
    """Number of processes in the job."""
    return _query("size")


def local_rank() -> int:
    """Rank among the processes on this node (use it to pick a GPU)."""
    return _query("local_rank")


def local_size() -> int:
    """Number of the job's processes on this node."""
    return _query("local_size")


def cross_rank() -> int:
    """Rank among the job's processes that have this process's local rank (the node index)."""
    return _query("cross_rank")


def cross_size() -> int:
    """Number of processes that share this process's local rank (normally the node count)."""
    return _query("cross_size")


def world_transport() -> Any:
    """The :class:`~hvd_slim.transport.mpi.MpiTransport` for the optimizer's exchange, on a
    communicator of its own so API collectives never interleave with it. Cached; collective only
    when it starts hvd_slim from an initialised Horovod."""
    state = _require_started()
    if state.transport is None:
        from ..transport.mpi import MpiTransport  # importable: init() imported mpi4py
        state.transport = MpiTransport(state.exchange_comm)
    return state.transport


def mpi_threads_supported() -> bool:
    """Whether MPI runs with MPI_THREAD_MULTIPLE."""
    _require()
    return bool(_mpi().thread_multiple())


def mpi_enabled() -> bool:
    """True once initialised: hvd_slim always runs its collectives over MPI."""
    return _state is not None


def mpi_built() -> bool:
    """Whether mpi4py is installed (hvd_slim's only MPI binding); does not initialise MPI."""
    return importlib.util.find_spec("mpi4py") is not None


def gloo_enabled() -> bool:
    """Always False: hvd_slim has no Gloo controller."""
    return False


def gloo_built() -> bool:
    """Always False: hvd_slim has no Gloo controller."""
    return False


def nccl_built() -> bool:
    """Always False: collectives go through MPI (CUDA tensors are staged through host memory)."""
    return False


def ddl_built() -> bool:
    """Always False (IBM DDL is not supported)."""
    return False


def ccl_built() -> bool:
    """Always False (oneCCL is not supported)."""
    return False


def cuda_built() -> bool:
    """Always False: there are no GPU kernels; CUDA tensors work by staging through the CPU."""
    return False


def rocm_built() -> bool:
    """Always False: there are no ROCm kernels."""
    return False


__all__: List[str] = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "world_transport", "job_comm",
    "job_collectives", "NOT_INITIALIZED",
]
