"""Horovod's build queries (``mpi_built``, ``gloo_built``, ...): what this package can do,
answered without starting MPI. hvd_slim's collectives run over mpi4py under an MPI launcher and
over torch.distributed's Gloo under torchrun; the optimizer's NCCL transport (``transport=``)
is not reported here.
"""
from __future__ import annotations

import importlib.util

import torch.distributed as dist

from . import basics

__all__ = ["mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
           "cuda_built", "rocm_built"]


def mpi_built() -> bool:
    """Whether mpi4py is installed (hvd_slim's only MPI binding); does not initialise MPI.

    Returns:
        True when mpi4py can be imported, else False.
    """
    return importlib.util.find_spec("mpi4py") is not None


def gloo_enabled() -> bool:
    """Whether Gloo runs the collectives: under torchrun (hvd_slim on torch.distributed).

    Returns:
        True when hvd_slim is initialised on torch.distributed's Gloo, else False.
    """
    state = basics._state
    return state is not None and state.world is not None


def gloo_built() -> bool:
    """Whether Gloo can run the collectives: torch.distributed's Gloo, which ``hvd.init()``
    uses under torchrun (and ``transport="gloo"`` for the optimizer).

    Returns:
        True when this torch has torch.distributed with Gloo, else False.
    """
    return bool(dist.is_available() and dist.is_gloo_available())


def nccl_built() -> bool:
    """Whether NCCL collectives are built in: no, they go through MPI (CUDA tensors are staged
    through host memory).

    Returns:
        False.
    """
    return False


def ddl_built() -> bool:
    """Whether IBM DDL support is built in: no, DDL is not supported.

    Returns:
        False.
    """
    return False


def ccl_built() -> bool:
    """Whether oneCCL support is built in: no, oneCCL is not supported.

    Returns:
        False.
    """
    return False


def cuda_built() -> bool:
    """Whether CUDA kernels are built in: no; CUDA tensors work by staging through the CPU.

    Returns:
        False.
    """
    return False


def rocm_built() -> bool:
    """Whether ROCm kernels are built in: no, there are none.

    Returns:
        False.
    """
    return False
