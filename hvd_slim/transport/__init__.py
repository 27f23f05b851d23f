"""Transports: the only code that talks to a network (mpi4py, torch.distributed) or simulates one.

``MpiTransport`` (``transport.mpi``) is imported on first use, so ``import hvd_slim`` does not
start MPI; ``TorchDistTransport`` (``transport.torch_dist``, Gloo or NCCL) starts nothing until
a process group is made.
The public tensor API's MPI collectives are ``MpiCollectives`` in ``transport.mpi_api``; the
communicators the runtime makes, and the MPI error wrapper, are in ``transport.mpi_comm``. Every
deadline is ``Deadlines.watch`` (``transport.base``), polled by ``transport.deadline``.
Tensor payloads (the exchange's device path): ``torch_dist`` framed by ``torch_frames`` for
Gloo/NCCL (``torch_cache`` keeps one transport per backend and device), ``mpi_device`` for
MPI (CUDA-aware or staged), ``staging`` for pinned host buffers and the default.
"""
from .base import LENGTH_BYTES, Transport, TransportError, TransportStats
from .fake import FakeCluster, FakeTransport, run_ranks
from .torch_dist import TorchDistTransport

__all__ = ["LENGTH_BYTES", "Transport", "TransportError", "TransportStats", "FakeCluster",
           "FakeTransport", "run_ranks", "TorchDistTransport"]

