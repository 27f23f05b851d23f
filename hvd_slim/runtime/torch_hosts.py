"""The host and cross-host transports of ``hierarchical=True`` on Gloo or NCCL: process groups
among each host's ranks and among the l-th ranks of every host (exchange/hosts/hierarchy.py).

Hosts are named as hvd_slim names them everywhere (runtime/hosts.py): by
``HVD_SLIM_HOST_KEY`` where it is set, else by the machine's host name; the keys are gathered
over the world's group, so every rank sees the same hosts. ``torch.distributed.new_group`` is
collective over the whole world, so every rank creates every group, in the same order.
"""
from __future__ import annotations

import os
import socket
from typing import Any, Dict, List, Tuple

import torch.distributed as dist

from ..transport.torch_dist import TorchDistTransport
from .hosts import HOST_KEY_VAR, host_colors, host_table

_made: Dict[int, Tuple[List[int], TorchDistTransport, TorchDistTransport]] = {}


def host_transports(world: TorchDistTransport) -> Tuple[List[int], TorchDistTransport,
                                                        TorchDistTransport]:
    """``(hosts, local, cross)`` on ``world``'s backend: each rank's host number, the transport
    among this host's ranks (rank order) and among this local rank's peers (by host). Cached
    per world transport; collective on first call."""
    if id(world) in _made and not world._closed:
        return _made[id(world)]
    keys: List[Any] = [None] * world.size
    dist.all_gather_object(keys, os.environ.get(HOST_KEY_VAR) or socket.gethostname(),
                           group=world.group)
    hosts = host_colors(keys) or [0] * world.size
    table = host_table(hosts)   # hosts of different sizes: the same error on every rank
    me = world.rank
    host = hosts[me]
    local = cross = None
    for members in table:   # every rank makes every group, in the same order
        group = dist.new_group(members, timeout=world.timeout, backend=world.name)
        if me in members:
            local = _transport(world, group, members.index(me), len(members))
    for l in range(len(table[0])):
        members = [t[l] for t in table]
        group = dist.new_group(members, timeout=world.timeout, backend=world.name,
                               sort_ranks=False)   # numbered by host, not by rank
        if me in members:
            cross = _transport(world, group, host, len(members))
    _made[id(world)] = (hosts, local, cross)
    return _made[id(world)]


def _transport(world: TorchDistTransport, group: Any, rank: int, size: int
               ) -> TorchDistTransport:
    return TorchDistTransport(group, world.name, world.device, rank, size, world.timeout,
                              on_close=lambda: dist.destroy_process_group(group))


def close_all() -> None:
    """Close every host transport (before the world's group goes)."""
    made = list(_made.values())
    _made.clear()
    for _, local, cross in made:
        for t in (local, cross):
            try:
                t.close()
            except Exception:  # noqa: BLE001 - teardown must reach every group
                pass
