"""hvd_slim: Horovod's PyTorch API with a Slim-DP sparse gradient exchange underneath.

``import hvd_slim as hvd`` in place of ``import horovod.torch as hvd``: the same ``init``,
``rank``, collectives and ``broadcast_*`` helpers, and a ``DistributedOptimizer`` whose
exchange sends a small, well-chosen slice of each gradient instead of all of it. See README.md.
"""
from . import elastic
from .api.alltoall import alltoall, alltoall_async
from .api.async_ops import (allgather_async, allreduce_async, allreduce_async_, broadcast_async,
                            broadcast_async_, poll, synchronize)
from .api.checks import MismatchError
from .api.collectives import (Adasum, Average, Max, Min, Product, Sum, allgather, allreduce,
                              allreduce_, broadcast, broadcast_)
from .api.compression import Compression
from .api.functions import (allgather_object, barrier, broadcast_object, broadcast_optimizer_state,
                            broadcast_parameters)
from .api.grouped import (grouped_allgather, grouped_allgather_async, grouped_allreduce,
                          grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_,
                          grouped_reducescatter, grouped_reducescatter_async)
from .api.join import join
from .api.lifecycle import add_process_set, init, remove_process_set, shutdown
from .api.process_sets import ProcessSet, global_process_set
from .api.scatter import reducescatter, reducescatter_async
from .api.sparse import sparse_allreduce_async
from .api.sync_batch_norm import SyncBatchNorm
from .api.timeline import start_timeline, stop_timeline
from .config import ConfigError, SlimConfig
from .elastic.errors import HostsUpdatedInterrupt
from .exchange import ExchangeError
from .exchange.errors import NonFiniteGradientError
from .optim.distributed_optimizer import DistributedOptimizer
from .runtime import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                      gloo_enabled, is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                      mpi_threads_supported, nccl_built, rank, rocm_built, size)
from .transport.base import HorovodInternalError, TransportError, TransportTimeout

__version__ = "0.1.0"

__all__ = [
    # runtime
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
    "rocm_built",
    # collectives
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression", "allreduce",
    "allreduce_", "allreduce_async", "allreduce_async_", "allgather", "allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "poll", "synchronize",
    "join", "barrier", "broadcast_object", "allgather_object", "broadcast_parameters",
    "broadcast_optimizer_state", "MismatchError", "SyncBatchNorm",
    "reducescatter", "reducescatter_async", "alltoall", "alltoall_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_allgather", "grouped_allgather_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "sparse_allreduce_async",
    "start_timeline", "stop_timeline",
    # process sets
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    # Slim-DP
    "DistributedOptimizer", "SlimConfig", "ConfigError", "ExchangeError",
    "NonFiniteGradientError", "TransportError", "TransportTimeout", "HorovodInternalError",
    "HostsUpdatedInterrupt",
    # elastic training (hvd.elastic.run, TorchState, ...)
    "elastic",
]
