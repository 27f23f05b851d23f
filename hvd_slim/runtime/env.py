"""Rank discovery from the launcher's environment (mpirun, PMI launchers, horovodrun, torchrun).

Under an MPI launcher the values cross-check MPI at ``init()``: a process started by a launcher
whose MPI differs from the one mpi4py loaded comes up as a lone singleton, and without this
check every rank would silently train alone as "rank 0 of 1". Under torchrun (``RANK`` and
``WORLD_SIZE``, runtime/torch_world.py) they are the job's ranks.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional, Tuple

# (rank variable, size variable), in the order they are consulted.
ENV_PAIRS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
    ("HOROVOD_RANK", "HOROVOD_SIZE"),
    ("RANK", "WORLD_SIZE"),  # torchrun
)


def _read_int(env: Mapping[str, str], var: str) -> int:
    raw = env[var]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {var}={raw!r} is not an integer; unset it or fix the "
                         f"launcher") from None


def env_rank_size(env: Optional[Mapping[str, str]] = None) -> Optional[Tuple[int, int, str]]:
    """``(rank, size, source)`` announced by the launcher, or None when no launcher variables are
    set. ``source`` names the variables used. Raises ValueError when two launchers' variables
    disagree or a pair is incomplete or out of range."""
    env = os.environ if env is None else env
    found = []
    for rank_var, size_var in ENV_PAIRS:
        has_rank, has_size = rank_var in env, size_var in env
        if has_rank != has_size:
            missing = size_var if has_rank else rank_var
            raise ValueError(f"{rank_var if has_rank else size_var} is set but {missing} is not; "
                             f"the launcher environment is incomplete")
        if has_rank:
            rank, size = _read_int(env, rank_var), _read_int(env, size_var)
            if not 0 <= rank < size:
                raise ValueError(f"{rank_var}={rank} is not in [0, {size_var}={size})")
            found.append((rank, size, f"{rank_var}/{size_var}"))
    for other in found[1:]:
        if other[:2] != found[0][:2]:
            raise ValueError(f"launcher variables disagree: {found[0][2]} say rank {found[0][0]} of "
                             f"{found[0][1]} but {other[2]} say rank {other[0]} of {other[1]}")
    return found[0] if found else None


def check_against_mpi(mpi_rank: int, mpi_size: int, env: Optional[Mapping[str, str]] = None) -> None:
    """Raise RuntimeError if the launcher's rank/size differ from MPI.COMM_WORLD's."""
    announced = env_rank_size(env)
    if announced is None:
        return
    rank, size, source = announced
    if (rank, size) != (mpi_rank, mpi_size):
        raise RuntimeError(
            f"hvd_slim.init(): the launcher says this is rank {rank} of {size} ({source}) but MPI "
            f"reports rank {mpi_rank} of {mpi_size} (MPI.COMM_WORLD). mpi4py is probably built "
            f"against a different MPI than the one that launched the job, or the job was started "
            f"by horovodrun --gloo (hvd_slim needs MPI): launch with the mpirun that matches "
            f"mpi4py (check `python -c 'from mpi4py import MPI; print(MPI.Get_library_version())'`).")
