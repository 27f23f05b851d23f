"""Transports: the only code that talks to a network (mpi4py, torch.distributed) or simulates one."""
from .base import LENGTH_BYTES, Transport, TransportError, TransportStats
from .fake import FakeCluster, FakeTransport, run_ranks

__all__ = ["LENGTH_BYTES", "Transport", "TransportError", "TransportStats", "FakeCluster",
           "FakeTransport", "run_ranks"]
