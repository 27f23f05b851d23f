"""Which exchange an optimizer gets: :class:`SlimExchange`, or with ``hierarchical=True`` the
host-first :class:`~hvd_slim.exchange.hierarchy.HierarchicalExchange`."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from ..config import ConfigError, SlimConfig
from ..transport.base import Transport
from .layout import Layout
from .step import SlimExchange


def build_exchange(layout: Layout, config: SlimConfig, transport: Transport,
                   momentum: Optional[Dict[int, dict]] = None,
                   ranks: Optional[Sequence[int]] = None) -> Any:
    """The exchange for ``config`` on ``transport``. ``hierarchical=True`` needs the whole
    job's MPI transport (the runtime's :func:`~hvd_slim.runtime.basics.world_transport`): its
    hosts come from ``local_size()`` (``HVD_SLIM_HOST_KEY``, else shared memory). With one rank
    per host it is the flat exchange."""
    if not config.hierarchical:
        return SlimExchange(layout, config, transport, momentum, ranks=ranks)
    from ..runtime import basics
    note = config.env_note("hierarchical")
    if ranks is not None:
        raise ConfigError("hierarchical=True runs over the whole job; it cannot be combined "
                          f"with a process_set{note}", "hierarchical")
    if transport.name != "mpi" or transport is not basics.world_transport():
        raise ConfigError(f"hierarchical=True needs transport='mpi' (got {transport.name!r}): "
                          "the host and cross-host groups are MPI communicators. Pass "
                          f"transport='mpi' or hierarchical=False{note}", "hierarchical")
    from .hierarchy import HierarchicalExchange, host_table
    hosts, local, cross = basics.host_transports()
    # The same host list on every rank, so unequal hosts are refused on every rank alike.
    if len(host_table(hosts)[0]) == 1:
        return SlimExchange(layout, config, transport, momentum)   # a rank per host: flat
    return HierarchicalExchange(layout, config, transport, local, cross, hosts, momentum)
