"""Running inside an installed Horovod: detect its initialisation and check it against MPI.

A script may ``import horovod.torch as hvd; hvd.init()`` and use only
``hvd_slim.DistributedOptimizer``. hvd_slim then starts itself on MPI.COMM_WORLD, which is the
world Horovod runs on under ``mpirun`` and ``horovodrun`` (MPI mode), and checks that both agree on
rank and size. Horovod is never imported here: only a ``horovod.torch`` the script already
imported is consulted, so hvd_slim never requires Horovod.
"""
from __future__ import annotations

import atexit
import inspect
import sys
from typing import Any, Optional

GLOO_ONLY = (
    "Horovod is running on Gloo without MPI (horovodrun --gloo, or a Horovod built without MPI), "
    "but hvd_slim exchanges over MPI and takes its ranks from MPI.COMM_WORLD. Launch with "
    "`horovodrun --mpi -np N ...` or `mpirun -np N ...` (and build Horovod with "
    "HOROVOD_WITH_MPI=1, see `make install-horovod`)")


def initialized_horovod() -> Optional[Any]:
    """The ``horovod.torch`` module when the script imported it and called ``hvd.init()``; else
    None. Never imports Horovod."""
    hvd = sys.modules.get("horovod.torch")
    if hvd is None:
        return None
    try:
        return hvd if hvd.is_initialized() else None
    except Exception:  # noqa: BLE001 - a half-imported or shut-down Horovod counts as absent
        return None


def check_not_gloo_only() -> None:
    """Raise RuntimeError when Horovod was initialised on Gloo alone. Called before MPI starts,
    since under ``horovodrun --gloo`` MPI would come up as a lone singleton on every rank."""
    hvd = initialized_horovod()
    if hvd is not None and not hvd.mpi_enabled():
        raise RuntimeError(GLOO_ONLY)


def check_against(rank: int, size: int, what: str = "MPI.COMM_WORLD (mpi4py)") -> None:
    """Raise RuntimeError when an initialised Horovod's rank/size differ from ``(rank, size)``,
    the position of this process in ``what`` (the communicator hvd_slim is about to run on)."""
    hvd = initialized_horovod()
    if hvd is None:
        return
    check_not_gloo_only()
    ours, theirs = (rank, size), (hvd.rank(), hvd.size())
    if ours != theirs:
        raise RuntimeError(
            f"hvd_slim: Horovod says this is rank {theirs[0]} of {theirs[1]} but {what} "
            f"says rank {ours[0]} of {ours[1]}. hvd_slim follows Horovod only when Horovod "
            f"runs on the whole MPI world: call hvd.init() without a communicator, or call "
            f"hvd_slim.init(comm=...) with the same ranks you gave Horovod; if mpi4py was built "
            f"against another MPI than Horovod, rebuild it (`pip install --no-binary mpi4py mpi4py`)")


_exit_barrier = False


def register_exit_barrier() -> None:
    """When Horovod initialised MPI, it finalises it on every rank as soon as any one rank shuts
    Horovod down (at exit), which would pull MPI away from a peer still inside an hvd_slim
    collective (a segfault in MPI, seen here under mpirun -np 3). So before Horovod's own exit
    handler runs (atexit runs the latest registration first), every rank waits in a Horovod
    barrier until all ranks have reached exit, i.e. finished with MPI. Idempotent."""
    global _exit_barrier
    if not _exit_barrier:
        _exit_barrier = True
        atexit.register(_barrier_at_exit)


def _barrier_at_exit() -> None:
    hvd = initialized_horovod()
    if hvd is None:
        return
    try:
        if hasattr(hvd, "barrier"):
            hvd.barrier()
        else:  # Horovod < 0.23 has no barrier: a tiny allreduce synchronises just the same
            import torch
            hvd.allreduce(torch.zeros(1), name="hvd_slim.exit_barrier")
    except Exception:  # noqa: BLE001 - Horovod already shut down (by the script or a peer)
        pass


def called_by_horovod_state_init() -> bool:
    """Whether ``step()`` was called by Horovod's ``broadcast_optimizer_state`` (any version:
    the function has kept its name and its ``horovod.*`` module). torch's own wrappers around
    ``step`` (profiling hooks, an LR scheduler's call counter) are looked through."""
    frame = inspect.currentframe()
    try:
        caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
        for _ in range(8):
            if caller is None:
                return False
            module = str(caller.f_globals.get("__name__", ""))
            if module != "torch" and not module.startswith("torch."):
                return (caller.f_code.co_name == "broadcast_optimizer_state"
                        and module.startswith("horovod."))
            caller = caller.f_back
        return False
    finally:
        del frame   # a frame reference would keep every local of the stack alive
