"""Process-level state in Horovod's shape: ``init``/``shutdown``, rank and size queries, build
flags, and the job communicator that the tensor API and the optimizer's transport run on.

mpi4py is imported (and MPI initialised) only inside :func:`init`, so ``import hvd_slim`` stays
cheap and works on a machine without MPI.
"""
from __future__ import annotations

import importlib.util
import threading
from dataclasses import dataclass
from typing import Any, List, Optional

from . import abort, env

NOT_INITIALIZED = "hvd_slim has not been initialized; use hvd.init()."


@dataclass
class _State:
    comm: Any            # the job communicator (a private Dup); the tensor API runs on it
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
    try:
        from ..transport import mpi
    except ImportError as exc:
        raise ImportError(f"hvd_slim needs mpi4py and an MPI library ({exc}); install them, e.g. "
                          f"`apt-get install libopenmpi-dev && pip install mpi4py`") from exc
    return mpi


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
        mpi = _mpi()
        # Installed first so a failure from here on still ends every rank of the job.
        abort.install()
        env.check_against_mpi(*mpi.world_rank_size())
        job = _job_comm(mpi, comm)
        rank, size = job.Get_rank(), job.Get_size()
        local = mpi.split_shared(job)
        local_rank, local_size = local.Get_rank(), local.Get_size()
        # Ranks with the same local rank form one cross communicator (one rank per node).
        cross = mpi.split(job, local_rank, rank)
        _state = _State(comm=job, exchange_comm=mpi.dup(job), local_comm=local, cross_comm=cross,
                        rank=rank, size=size, local_rank=local_rank, local_size=local_size,
                        cross_rank=cross.Get_rank(), cross_size=cross.Get_size())


def shutdown() -> None:
    """Release hvd_slim's communicators; :func:`init` may be called again afterwards."""
    global _state
    with _lock:
        state, _state = _state, None
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


def job_comm() -> Any:
    """The job communicator the public tensor API runs its collectives on."""
    return _require().comm


def rank() -> int:
    """This process's rank in the job, in [0, size())."""
    return _require().rank


def size() -> int:
    """Number of processes in the job."""
    return _require().size


def local_rank() -> int:
    """Rank among the processes on this node (use it to pick a GPU)."""
    return _require().local_rank


def local_size() -> int:
    """Number of the job's processes on this node."""
    return _require().local_size


def cross_rank() -> int:
    """Rank among the job's processes that have this process's local rank (the node index)."""
    return _require().cross_rank


def cross_size() -> int:
    """Number of processes that share this process's local rank (normally the node count)."""
    return _require().cross_size


def world_transport() -> Any:
    """The :class:`~hvd_slim.transport.mpi.MpiTransport` for the optimizer's exchange, on a
    communicator of its own so API collectives never interleave with it. Cached; not collective."""
    state = _require()
    if state.transport is None:
        state.transport = _mpi().MpiTransport(state.exchange_comm)
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
    "NOT_INITIALIZED",
]
