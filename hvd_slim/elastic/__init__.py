"""Elastic training in Horovod's shape (``hvd.elastic``): state objects that commit, restore and
sync, a sampler that repartitions, and a ``run`` loop that survives a failed collective by
restoring the last commit on the surviving ranks. What works and what does not:
docs/elastic.md.
"""
from .errors import HorovodInternalError, HostsUpdatedInterrupt
from .runner import run
from .sampler import ElasticSampler
from .state import ObjectState, State
from .torch_state import TorchState

__all__ = ["State", "ObjectState", "TorchState", "ElasticSampler", "run",
           "HorovodInternalError", "HostsUpdatedInterrupt"]
