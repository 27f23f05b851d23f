"""``DistributedOptimizer(..., process_set=ps)`` on a rank outside ``ps``: the wrapped optimizer
alone.

Horovod lets every rank build the optimizer; where the rank is not in the set it registers no
hooks and reduces nothing, so that rank trains on its own gradients (Horovod's
``test_optimizer_process_sets`` builds the even ranks' optimizer on the odd ranks too and checks
that they drift apart). hvd_slim does the same: no exchange and no communication here, the
plain step of the user's optimizer class, and Horovod's methods (plus hvd_slim's extras) present
so a script runs unchanged on every rank.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Iterator, List

import torch

from ..exchange.loss_scale import checked_scaler
from .wrapping import SlimSettings, adopt_source


class _OutsideSetOptimizer(torch.optim.Optimizer):
    """Methods copied into the dynamic subclass of the user's optimizer class."""

    def __init__(self, params, settings: SlimSettings, source: torch.optim.Optimizer) -> None:
        super(self.__class__, self).__init__(params)
        adopt_source(self, settings, source)   # as the in-set optimizer does

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Checked as inside the set; gradients simply accumulate until ``step()``."""
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {passes!r}")
        self.backward_passes_per_step = passes

    def synchronize(self) -> None:
        """Nothing to exchange outside the process set."""

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        yield

    def flush(self) -> None:
        """Nothing is held back outside the process set."""

    def set_grad_scaler(self, scaler: Any) -> None:
        """Checked as inside the set; nothing here is kept between steps, so nothing to tell."""
        checked_scaler(scaler, "set_grad_scaler")

    def comm_stats(self) -> Dict[str, Any]:
        """No traffic: this rank is not in the optimizer's process set."""
        return {"steps": 0, "bytes_pushed": 0, "bytes_pulled": 0, "transport": None,
                "world_size": 0, "in_process_set": False,
                "process_set_ranks": list(self._settings.ranks or [])}

    @property
    def slim_config(self):
        """The validated :class:`hvd_slim.SlimConfig` (the same on every rank of the job)."""
        return self._settings.config

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """The wrapped optimizer's state; a checkpoint with Slim-DP state came from a member of
        the set and is refused."""
        if isinstance(state_dict, dict) and "hvd_slim" in state_dict:
            raise ValueError(f"this rank is outside the optimizer's process_set "
                             f"{self._settings.ranks}, but the checkpoint holds a member's "
                             f"Slim-DP state: load each rank's own checkpoint")
        super(self.__class__, self).load_state_dict(state_dict)


def outside_set_optimizer(optimizer: torch.optim.Optimizer, settings: SlimSettings
                          ) -> torch.optim.Optimizer:
    """The wrapper for a rank outside ``settings.ranks``: same class name and hyperparameters."""
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_OutsideSetOptimizer.__dict__))
    return cls(optimizer.param_groups, settings, optimizer)


__all__: List[str] = ["outside_set_optimizer"]
