"""Runtime: MPI start-up and rank discovery, abort-all-ranks on error, Horovod's basics."""
from .basics import (NOT_INITIALIZED, cross_rank, cross_size, init, is_initialized,
                     job_collectives, job_comm, local_rank, local_size, mpi_enabled,
                     mpi_threads_supported, rank, shutdown, size, world_transport)
from .build_flags import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, mpi_built,
                          nccl_built, rocm_built)
from .env import env_rank_size

__all__ = ["NOT_INITIALIZED", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
           "env_rank_size", "gloo_built", "gloo_enabled", "init", "is_initialized",
           "job_collectives", "job_comm", "local_rank", "local_size", "mpi_built", "mpi_enabled",
           "mpi_threads_supported", "nccl_built", "rank", "rocm_built", "shutdown", "size",
           "world_transport"]
