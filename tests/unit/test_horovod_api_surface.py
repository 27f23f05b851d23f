"""Every public name of Horovod 0.28.1's ``horovod.torch`` exists in hvd_slim, so a script that
swaps its import finds each one (docs/runtime.md, "The runtime API", lists the same surface)."""
from __future__ import annotations

import inspect

import pytest

import hvd_slim

pytestmark = pytest.mark.unit

# horovod/torch/__init__.py at v0.28.1, name by name.
HOROVOD_TORCH = """
elastic Compression allgather_object broadcast_object broadcast_optimizer_state
broadcast_parameters allreduce allreduce_async allreduce_ allreduce_async_ grouped_allreduce
grouped_allreduce_async grouped_allreduce_ grouped_allreduce_async_ sparse_allreduce_async
allgather allgather_async grouped_allgather grouped_allgather_async broadcast broadcast_async
broadcast_ broadcast_async_ alltoall alltoall_async reducescatter reducescatter_async
grouped_reducescatter grouped_reducescatter_async join barrier poll synchronize init shutdown
is_initialized start_timeline stop_timeline size local_size cross_size rank local_rank
cross_rank mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built nccl_built
ddl_built ccl_built cuda_built rocm_built ProcessSet global_process_set add_process_set
remove_process_set Average Sum Adasum Min Max Product HorovodInternalError
DistributedOptimizer SyncBatchNorm
""".split()
ELASTIC = "TorchState ElasticSampler run State ObjectState".split()


def test_every_horovod_torch_name_is_provided():
    missing = [n for n in HOROVOD_TORCH if not hasattr(hvd_slim, n)]
    assert not missing, f"hvd_slim lacks horovod.torch's {missing}"
    assert set(HOROVOD_TORCH) <= set(hvd_slim.__all__)


def test_elastic_names_are_provided():
    assert [n for n in ELASTIC if not hasattr(hvd_slim.elastic, n)] == []


@pytest.mark.parametrize("name, params", [
    ("allreduce", ["tensor", "average", "name", "compression", "op", "prescale_factor",
                   "postscale_factor", "process_set"]),
    ("reducescatter", ["tensor", "name", "compression", "op", "process_set", "prescale_factor",
                       "postscale_factor"]),
    ("alltoall", ["tensor", "splits", "name", "process_set"]),
    ("grouped_allreduce", ["tensors", "average", "name", "compression", "op", "prescale_factor",
                           "postscale_factor", "process_set"]),
    ("broadcast_object", ["obj", "root_rank", "name", "process_set"]),
    ("join", ["device"]),
    ("barrier", ["process_set"]),
])
def test_signatures_take_horovods_arguments_in_order(name, params):
    got = list(inspect.signature(getattr(hvd_slim, name)).parameters)
    assert got[:len(params)] == params, got


def test_communication_failures_are_horovod_internal_errors():
    assert issubclass(hvd_slim.HorovodInternalError, RuntimeError)
    assert issubclass(hvd_slim.TransportTimeout, hvd_slim.HorovodInternalError)
    assert issubclass(hvd_slim.MismatchError, RuntimeError)
    assert issubclass(hvd_slim.MismatchError, ValueError)
