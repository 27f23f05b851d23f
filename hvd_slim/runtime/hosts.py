"""Which ranks share a host, for ``local_rank()``, ``local_size()`` and the cross communicator.

MPI's shared-memory split (``MPI_Comm_split_type(COMM_TYPE_SHARED)``) answers this wherever
ranks of one host can share memory. Where that is not what a host means (every "host" a
network namespace or a container on one machine, as benchmarks/cluster.py builds, or a
launcher that puts unrelated jobs' ranks on one node), ``HVD_SLIM_HOST_KEY`` names each rank's
host: ranks with the same key are one host, ordered by rank. It must be set on every rank or on
none; every rank checks the same gathered keys, so all raise the same error together.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from ..config import ConfigError

HOST_KEY_VAR = "HVD_SLIM_HOST_KEY"


@dataclass
class Placement:
    """This process's place in the job: what ``rank()``, ``size()``, ``local_rank()``,
    ``local_size()``, ``cross_rank()`` and ``cross_size()`` answer. The runtime's state holds
    it on either launcher (runtime/basics.py), as does the job on torch.distributed
    (runtime/torch_world.py) that it copies it from under torchrun."""
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def host_colors(keys: List[Optional[str]]) -> Optional[List[int]]:
    """Each rank's host number (the rank order of the hosts' first ranks) from every rank's
    ``HVD_SLIM_HOST_KEY`` (None: not set); None when no rank sets it. ValueError when only some
    do, or a key is blank."""
    if all(k is None for k in keys):
        return None
    bad = [r for r, k in enumerate(keys) if k is None or not k.strip()]
    if bad:
        raise ValueError(f"{HOST_KEY_VAR} is unset or empty on rank(s) "
                         f"{', '.join(map(str, bad))} but set on others: set it on every rank "
                         "(the name of the rank's host) or on none (MPI's shared-memory split "
                         "then decides)")
    first: Dict[str, int] = {}
    for k in keys:
        first.setdefault(k.strip(), len(first))
    return [first[k.strip()] for k in keys]


def local_comm(mpi: Any, job: Any) -> Any:
    """The communicator of the ranks of ``job`` on this rank's host, ordered by rank in ``job``
    (collective over ``job``)."""
    colors = host_colors(job.allgather(os.environ.get(HOST_KEY_VAR)))
    if colors is None:
        return mpi.split_shared(job)
    rank = job.Get_rank()
    return mpi.split(job, colors[rank], rank)


def host_transports(mpi: Any, job: Any, local: Any) -> tuple:
    """``(hosts, local transport, cross transport)`` for ``hierarchical=True``
    (exchange/hosts/hierarchy.py): each rank's host number (the rank order of the hosts' first
    ranks), the exchange's transport among this host's ranks (rank order) and among the ranks of
    this local rank on every host (numbered by host). Collective over ``job``."""
    from ..transport.mpi import MpiTransport
    first = int(local.allreduce(job.Get_rank(), op=mpi.MPI.MIN))
    firsts = [int(f) for f in job.allgather(first)]
    number = {f: h for h, f in enumerate(sorted(set(firsts)))}
    hosts = [number[f] for f in firsts]
    cross = mpi.split(job, local.Get_rank(), hosts[job.Get_rank()])
    return hosts, MpiTransport(mpi.dup(local)), MpiTransport(cross)


def host_table(hosts: Sequence[int]) -> List[List[int]]:
    """The ranks of each host (hosts numbered 0..H-1, each host's ranks in rank order) from each
    rank's host number; a ValueError naming the hosts unless every host has as many ranks."""
    by_host: Dict[int, List[int]] = {}
    for r, h in enumerate(hosts):
        by_host.setdefault(int(h), []).append(r)
    table = [by_host[h] for h in sorted(by_host)]
    if len({len(t) for t in table}) > 1:
        listed = "; ".join(f"host {h} has {len(t)} (ranks {', '.join(map(str, t))})"
                           for h, t in enumerate(table))
        raise ConfigError(f"hierarchical=True needs as many ranks on every host, but {listed}. "
                          "Launch the same number of ranks per host, or pass "
                          "hierarchical=False", "hierarchical")
    return table
