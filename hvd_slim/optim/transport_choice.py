"""Which transport an optimizer's exchange runs on: ``transport="mpi" | "gloo" | "nccl" | "auto"``.
This module only chooses; the transports themselves are implemented in :mod:`hvd_slim.transport`.

The keyword wins; without it ``HVD_SLIM_TRANSPORT`` decides, then ``"auto"``:

* ``"auto"``: NCCL for CUDA parameters when torch.distributed has NCCL and a GPU is visible;
  otherwise MPI, except under torchrun (``hvd.init()`` there runs on torch.distributed, and
  without it hvd_slim is not started on MPI), where it is Gloo.
* ``"mpi"``: mpi4py on hvd_slim's own communicator (CUDA messages staged through pinned host
  buffers, or handed to MPI directly when it reports CUDA support).
* ``"gloo"``: torch.distributed's Gloo backend, on the host (CUDA messages staged, pinned).
* ``"nccl"``: torch.distributed's NCCL backend on the parameters' GPU (CUDA parameters only);
  values, indices and messages stay on the GPU (exchange/wirepath.py).
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any, List, Mapping, Optional

import torch

from ..api import process_sets
from ..runtime import basics, horovod
from ..transport.torch_dist import available_backends
from .rendezvous import torch_transport, torchrun_env

TRANSPORT_ENV = "HVD_SLIM_TRANSPORT"
NAMES = ("auto", "mpi", "gloo", "nccl")


def available(device: torch.device) -> List[str]:
    """The transport names usable for parameters on ``device`` on this machine."""
    out = ["auto"]
    if importlib.util.find_spec("mpi4py") is not None:
        out.append("mpi")
    try:
        import torch.distributed as dist
        out += available_backends(cuda=device.type == "cuda") if dist.is_available() else []
    except ImportError:  # a torch build without torch.distributed
        pass
    return out


def _why_unavailable(name: str, device: torch.device) -> str:
    if name == "nccl":
        if device.type != "cuda":
            return f"NCCL needs CUDA parameters and these are on {device}"
        return ("this torch has no NCCL or sees no GPU (torch.distributed.is_nccl_available() / "
                "torch.cuda.is_available() is False)")
    if name == "mpi":
        return "mpi4py is not installed (pip install mpi4py)"
    return "this torch build has no torch.distributed Gloo backend"


def choose_auto(device: torch.device) -> str:
    """What ``"auto"`` means for parameters on ``device`` here and now."""
    if "nccl" in available(device):
        return "nccl"
    if basics.is_initialized() and basics.backend() == "torch":
        return "gloo"
    started = basics.is_initialized() or horovod.initialized_horovod() is not None
    if not started and torchrun_env() is not None and "gloo" in available(device):
        return "gloo"
    return "mpi"


def resolve(transport: Any, device: torch.device,
            environ: Optional[Mapping[str, str]] = None, process_set: Any = None) -> Any:
    """The Transport for the name ``transport`` (None: ``HVD_SLIM_TRANSPORT``, then ``"auto"``)
    and parameters on ``device``. Collective the first time a transport is started.

    ``process_set`` (a registered set with this rank; None: the whole job): the exchange runs
    among the set's ranks on the transport the set made when it was registered: MPI, or Gloo
    under torchrun (``"auto"`` picks it). Any other is refused: torch.distributed groups are
    made collectively over every rank of the job, which a set's ranks alone cannot do.

    Under torchrun (hvd_slim on torch.distributed) ``"mpi"`` is refused: no MPI runs."""
    environ = os.environ if environ is None else environ
    source = "transport"
    if transport is None:
        raw = environ.get(TRANSPORT_ENV)
        transport = "auto" if raw is None else raw.strip().lower()
        if raw is not None:
            source = f"environment variable {TRANSPORT_ENV}"
    here = available(device)
    if not isinstance(transport, str) or transport not in NAMES:
        raise ValueError(f"{source}={transport!r} is not a transport: pass one of {here} "
                         f"(available here) or a hvd_slim.transport.Transport instance")
    on_torch = basics.is_initialized() and basics.backend() == "torch"
    if on_torch and transport == "mpi":   # installed or not: this job has no MPI
        raise basics.needs_mpi(f"{source}='mpi'", "the exchange would run on mpi4py; pass "
                               "transport='gloo', 'nccl' (CUDA parameters) or 'auto'")
    if transport not in here:
        raise ValueError(f"{source}={transport!r} is not available: "
                         f"{_why_unavailable(transport, device)}; available here: {here}")
    if process_set is not None:
        theirs = "gloo" if on_torch else "mpi"
        if transport not in ("auto", theirs):
            raise ValueError(f"{source}={transport!r} cannot run the exchange inside "
                             f"process_set={process_set!r}: hvd_slim runs a process set's "
                             f"exchange on the group the set made when it was registered, "
                             f"{theirs} here; pass transport={theirs!r} (or \"auto\")")
        return process_sets.exchange_transport(process_set)
    if transport == "auto":
        transport = choose_auto(device)
    if transport == "mpi":
        return basics.world_transport()
    return torch_transport(transport, device)
