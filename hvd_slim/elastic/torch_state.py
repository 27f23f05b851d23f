"""``TorchState``: a model, an optimizer (hvd_slim's ``DistributedOptimizer`` included, with its
exchange state), ``ElasticSampler``s and plain attributes, committed, restored and synced as one.

Each model, optimizer and sampler attribute gets a handler that keeps a deep copy of its
``state_dict()`` as the commit; everything else is an :class:`ObjectState` attribute. An hvd_slim
optimizer's ``state_dict()`` holds its exchange (residuals, velocities, selectors, the server's state)
under ``"hvd_slim"``, so a restore on the same ranks is bitwise. After the job shrank, that entry
belongs to a rank of a job that no longer exists: the exchange is rebuilt empty on the survivors
(:mod:`hvd_slim.elastic.rebind`) and the rest of the commit is restored.
"""
from __future__ import annotations

import copy
import sys
from typing import Any, Dict, Optional

import torch

from ..api import functions
from ..api.pending import drain_all
from ..runtime import basics
from . import rebind
from .sampler import ElasticSampler
from .state import ObjectState


class _Handler:
    """Commit, restore and sync of one attribute through its ``state_dict``."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved: Dict[str, Any] = {}
        self.save()

    def save(self) -> None:
        drain_all()   # overlap_forward: a model's updates still in flight land first
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self.saved))

    def reset(self) -> None:
        pass

    def sync(self) -> None:
        raise NotImplementedError


class _ModelHandler(_Handler):
    def sync(self) -> None:
        drain_all()
        functions.broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def restore(self) -> None:
        self._load_commit()

    def reset(self) -> None:
        # Called after restore() (the run loop's order, as Horovod's): if hvd_slim was rebuilt,
        # move the exchange onto it and load the commit again, now into the new exchange.
        if rebind.rebind(self.value):
            self._load_commit()

    def _load_commit(self) -> None:
        """Load the commit; its exchange state only where it belongs to this exchange (same
        rank and size), else the exchange keeps what it has (empty after a rebuild)."""
        saved = copy.deepcopy(self.saved)
        if (rebind.is_slim_optimizer(self.value) and not rebind.exchange_fits(self.value, saved)
                and saved.pop("hvd_slim", None) is not None):
            if basics.rank() == 0:
                sys.stderr.write("hvd_slim.elastic: the job size changed since the commit; the "
                                 "optimizer's exchange (residuals, server state) restarts empty "
                                 f"on {basics.size()} ranks\n")
        self.value.load_state_dict(saved)

    def sync(self) -> None:
        # The inner optimizer's state and options from rank 0; the exchange's state stays each
        # rank's own (residuals are per rank).
        functions.broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def reset(self) -> None:
        self.value.reset()   # repartition over the new ranks

    def sync(self) -> None:
        self.value.load_state_dict(functions.broadcast_object(self.value.state_dict(), 0,
                                                              name="ElasticSampler state"))


def _handler_for(value: Any) -> Optional[_Handler]:
    for kind, handler in ((torch.nn.Module, _ModelHandler),
                          (torch.optim.Optimizer, _OptimizerHandler),
                          (ElasticSampler, _SamplerHandler)):
        if isinstance(value, kind):
            return handler(value)
    return None


class TorchState(ObjectState):
    """State of a PyTorch training process: models, optimizers and samplers given as keywords
    are handled through their ``state_dict``; any other keyword is a plain attribute.

    ``sync()`` sends rank 0's model parameters and buffers, optimizer state and options,
    sampler progress and attributes to every rank (rank 0 is the lowest surviving COMM_WORLD
    rank after a failure). An hvd_slim ``DistributedOptimizer``'s exchange state is committed
    and restored bitwise with it, but never synced: it is per rank.

    Args:
        model: Optional ``torch.nn.Module``.
        optimizer: Optional ``torch.optim.Optimizer`` (hvd_slim's ``DistributedOptimizer`` too).
        **kwargs: More models, optimizers, :class:`ElasticSampler` s, or plain attributes
            (epoch, batch counters...).
    """

    def __init__(self, model: Optional[torch.nn.Module] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: Dict[str, _Handler] = {}
        plain: Dict[str, Any] = {}
        for name, value in kwargs.items():
            handler = _handler_for(value)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
        # Set through object.__setattr__: our __setattr__ needs _handlers to exist.
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(**plain)

    def save(self) -> None:
        """Commit a deep copy of every model, optimizer and sampler state and attribute.

        Returns:
            None.
        """
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        """Load the commit back into every model, optimizer and sampler (bitwise, the hvd_slim
        exchange state included) and reset the attributes.

        Returns:
            None.
        """
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def reset(self) -> None:
        """After hvd_slim was rebuilt on the survivors: move hvd_slim optimizers onto it and
        repartition samplers.

        Returns:
            None.
        """
        for handler in self._handlers.values():
            handler.reset()

    def sync(self) -> None:
        """Broadcast rank 0's state to every rank. Collective.

        Returns:
            None.
        """
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name: str, value: Any) -> None:
        # Assigning a new model/optimizer/sampler replaces what is tracked and commits it.
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].value = value
            handlers[name].save()
        super().__setattr__(name, value)
