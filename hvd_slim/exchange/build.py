"""Which exchange an optimizer gets: :class:`SlimExchange`, or with ``hierarchical=True`` the
host-first :class:`~hvd_slim.exchange.hosts.hierarchy.HierarchicalExchange`, and with
``overlap > 1`` a :class:`~hvd_slim.exchange.overlap.staged.StagedExchange` of either kind."""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

from ..config import ConfigError, SlimConfig
from ..runtime import basics
from ..runtime.hosts import host_table
from ..runtime.torch_hosts import host_transports
from ..transport.base import Transport
from ..transport.torch_dist import TorchDistTransport
from .hosts.hierarchy import HierarchicalExchange
from .layout import Layout
from .overlap.staged import StagedExchange
from .protocol import Exchange
from .step import SlimExchange


def build_exchange(layout: Layout, config: SlimConfig, transport: Transport,
                   momentum: Optional[Dict[int, dict]] = None,
                   ranks: Optional[Sequence[int]] = None,
                   order: Optional[Sequence[str]] = None) -> Exchange:
    """The exchange for ``config`` on ``transport``. ``hierarchical=True`` needs the whole
    job's transport: MPI's (hosts as ``local_size()`` sees them: ``HVD_SLIM_HOST_KEY``, else
    shared memory), or a Gloo/NCCL one (``HVD_SLIM_HOST_KEY``, else the host name). With one
    rank per host it is the flat exchange. ``overlap > 1`` cuts the parameters, in ``order``
    (the names as ``named_parameters`` gave them; None: the layout's), into stages."""
    make = _hierarchical(config, transport, ranks) if config.hierarchical else None
    if config.overlap > 1:
        names = list(order) if order is not None else \
            [s.name for b in layout.buckets for s in b.segments]
        return StagedExchange(layout, config, transport, momentum, ranks, names,
                              threaded=threads_allowed(transport), make_stage=make)
    if make is not None:
        return make(layout, momentum)
    return SlimExchange(layout, config, transport, momentum, ranks=ranks)


def _hierarchical(config: SlimConfig, transport: Transport,
                  ranks: Optional[Sequence[int]]) -> Optional[Callable[..., Exchange]]:
    """How to make the host-first exchange of a layout (each stage's, with ``overlap``); None
    with one rank per host, where it is the flat one."""
    note = config.env_note("hierarchical")
    if ranks is not None:
        raise ConfigError("hierarchical=True runs over the whole job; it cannot be combined "
                          f"with a process_set{note}", "hierarchical")
    hosts, local, cross = _host_transports(transport, note)
    # The same host list on every rank, so unequal hosts are refused on every rank alike.
    if len(host_table(hosts)[0]) == 1:
        return None

    def make(part: Layout, momentum: Optional[Dict[int, dict]]) -> Exchange:
        return HierarchicalExchange(part, config, transport, local, cross, hosts, momentum)
    return make


def _host_transports(transport: Transport, note: str) -> tuple:
    """Each rank's host and the host and cross-host transports beside ``transport``."""
    if isinstance(transport, TorchDistTransport):
        return host_transports(transport)
    if transport.name == "mpi" and basics.is_initialized() and \
            transport is basics.world_transport():
        return basics.host_transports()
    raise ConfigError(f"hierarchical=True needs the job's own transport ('mpi', 'gloo' or "
                      f"'nccl'), not {transport.name!r}: its host groups are built beside it. "
                      f"Pass one of those or hierarchical=False{note}", "hierarchical")


def threads_allowed(transport: Transport) -> bool:
    """Whether ``overlap`` may run the exchange on a thread of its own. MPI needs
    MPI_THREAD_MULTIPLE (the engine's thread uses MPI too); without it the stages run in
    ``step()``, as the same exchanges, so the results are the same. The transport answers,
    so that asking never initialises MPI in a process that uses another transport."""
    return transport.threads_allowed()
