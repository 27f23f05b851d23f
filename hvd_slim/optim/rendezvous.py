"""Start-up of the torch.distributed transports (``transport="gloo"`` / ``"nccl"``).

Three ways in, tried in this order:

1. hvd_slim runs on MPI (``hvd_slim.init()``, or Horovod's ``hvd.init()``): rank 0 opens a
   TCPStore on a free port and broadcasts ``host:port`` over MPI, so ``mpirun``/``horovodrun`` need
   no ``MASTER_ADDR`` (when it is set, it is the address rank 0 advertises).
2. torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): its ``env://``
   rendezvous, which also finds torchrun's agent store.
3. The script already called ``torch.distributed.init_process_group``: that world is used.

Under torchrun, ``hvd.init()`` starts hvd_slim on torch.distributed itself
(runtime/torch_world.py, which holds the store and registration used here too), so the
transports are groups on the default group it initialised.

If torch.distributed is already initialised, hvd_slim makes a private group on it (``new_group``)
after checking that its ranks agree; otherwise it initialises the default group itself. Every
rank first registers in the store, so a duplicated or missing rank or disagreeing world sizes
end in a clear error within the timeout (``HVD_SLIM_TRANSPORT_TIMEOUT`` seconds), never a hang.
"""
from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import numpy as np
import torch

from ..api import engine
from ..runtime import basics, horovod, torch_world
from ..transport import torch_cache, torch_dist

# The bootstrap's pieces live in the runtime, which starts hvd.init() under torchrun with them.
TIMEOUT_ENV, DEFAULT_TIMEOUT_S, TORCHRUN_VARS = (torch_world.TIMEOUT_ENV,
                                                 torch_world.DEFAULT_TIMEOUT_S,
                                                 torch_world.TORCHRUN_VARS)
timeout, torchrun_env = torch_world.timeout, torch_world.torchrun_env
_register, _first_line = torch_world.register, torch_world.first_line
_generation = 0  # bootstraps happen in the same order on every rank: a shared store key prefix


def torch_transport(backend: str, device: torch.device) -> Any:
    """The cached :class:`TorchDistTransport` for ``(backend, device)``, started on first use.
    Collective: every rank must ask for the same transports in the same order."""
    import torch.distributed as dist

    # Gloo frames live on the host whatever the parameters' device: one Gloo group serves all.
    dev = torch.device("cpu") if backend == "gloo" else torch.device(device)
    if dev.type == "cuda" and dev.index is None:   # one cache key, and set_device needs one
        dev = torch.device("cuda", torch.cuda.current_device())
    found = torch_cache.cached(backend, dev)
    if found is not None:
        return found
    tmo = timeout()
    if backend == "nccl":
        torch.cuda.set_device(dev)
    if basics.is_initialized() or horovod.initialized_horovod() is not None:
        basics.job_collectives()  # starts hvd_slim from Horovod when needed
        # Under torchrun hvd.init() has initialised torch.distributed: a group is made on it.
        rank, size, how = basics.rank(), basics.size(), basics.backend()
    elif torchrun_env() is not None:
        (rank, size), how = torchrun_env(), "torchrun"
    elif dist.is_available() and dist.is_initialized():
        rank, size, how = dist.get_rank(), dist.get_world_size(), "torch"
    else:
        raise ValueError(
            f"transport={backend!r} cannot find the job: call hvd_slim.init() (or Horovod's "
            f"hvd.init()) under mpirun/horovodrun, launch with torchrun ({', '.join(TORCHRUN_VARS)}), "
            f"or call torch.distributed.init_process_group() first")
    if dist.is_initialized():
        torch_world.check_default_group(f"transport={backend!r}", rank, size,
                                        f"hvd_slim's launcher ({how})", "the same ranks")
        group = dist.new_group(backend=backend, timeout=tmo)
        on_close = lambda: dist.destroy_process_group(group)  # noqa: E731
    else:
        global _generation
        _generation += 1
        store = _mpi_store(rank, size, tmo) if how == "mpi" else _torchrun_store(tmo)
        store = dist.PrefixStore(f"hvd_slim/{_generation}/", store)
        _register(store, rank, size, tmo)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=tmo)
        group, on_close = None, dist.destroy_process_group
    return torch_cache.remember(torch_dist.TorchDistTransport(group, backend, dev, rank, size, tmo,
                                                              on_close))


def _mpi_store(rank: int, size: int, tmo: datetime.timedelta) -> Any:
    """Rank 0 opens the store and sends its address over the job's MPI collectives; a failure
    there reaches every rank (as an error message instead of an address), so nobody waits for a
    store that never opens."""
    import torch.distributed as dist
    if rank == 0:
        store, host = None, os.environ.get("MASTER_ADDR") or (
            "127.0.0.1" if basics.local_size() == size else socket.gethostname())
        try:
            store = dist.TCPStore(host, 0, size, is_master=True, timeout=tmo, wait_for_workers=False)
            msg = f"ok {host} {store.port}"
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            msg = f"error rank 0 could not open a TCPStore on {host}: {_first_line(exc)}"
        with engine.on_group("the torch.distributed rendezvous", None) as group:
            group.api.bcast_bytes(np.frombuffer(msg.encode(), dtype=np.uint8), 0)
    else:
        with engine.on_group("the torch.distributed rendezvous", None) as group:
            msg = group.api.bcast_bytes(None, 0).tobytes().decode()
    if msg.startswith("error "):
        raise RuntimeError(f"hvd_slim rendezvous: {msg[6:]}; set MASTER_ADDR to an address of "
                           f"rank 0's node that every rank can reach")
    if rank == 0:
        return store
    _, host, port = msg.split()
    try:
        return dist.TCPStore(host, int(port), size, is_master=False, timeout=tmo)
    except Exception as exc:  # noqa: BLE001 - re-raised with the address and the fix
        raise RuntimeError(f"hvd_slim rendezvous: rank {rank} could not reach rank 0's store at "
                           f"{host}:{port} within {tmo.total_seconds():.0f}s: {_first_line(exc)}; "
                           f"set MASTER_ADDR to an address of rank 0's node that every rank can "
                           f"reach") from None


def _torchrun_store(tmo: datetime.timedelta) -> Any:
    return torch_world.env_store(tmo)
