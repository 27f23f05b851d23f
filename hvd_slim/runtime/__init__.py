"""Runtime: start-up on MPI or, under torchrun, on torch.distributed (torch_world.py), rank
discovery, abort-all-ranks on error, Horovod's basics (the public ``init`` and ``shutdown``
start and stop it with the engine: api/lifecycle.py)."""
from .basics import (NOT_INITIALIZED, backend, cross_rank, cross_size, is_initialized, job_collectives,
                     job_comm, local_rank, local_size, mpi_enabled, mpi_threads_supported, rank,
                     size, start, stop, world_transport)
from .build_flags import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, mpi_built,
                          nccl_built, rocm_built)
from .env import env_rank_size

__all__ = ["NOT_INITIALIZED", "backend", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
           "env_rank_size", "gloo_built", "gloo_enabled", "is_initialized",
           "job_collectives", "job_comm", "local_rank", "local_size", "mpi_built", "mpi_enabled",
           "mpi_threads_supported", "nccl_built", "rank", "rocm_built", "size", "start", "stop",
           "world_transport"]
