"""Lightning's side of the Slim-DP hook: one callback for what ``DDPStrategy`` leaves undone.

Lightning (2.x) registers a ``DDPStrategy(ddp_comm_hook=...)`` on CUDA devices only and drops it
silently on CPUs, and it makes the optimizer (``configure_optimizers``) after the strategy that
holds the hook's state, so a ``SlimState`` cannot be given its Adam at construction. This
callback does both at ``on_fit_start``, once the strategy has wrapped the model in DDP and
before the first step::

    state = SlimState()
    trainer = pl.Trainer(strategy="ddp", callbacks=[SlimHookCallback(state)])

Importing this module imports ``lightning``; the rest of hvd_slim never does.
"""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from .checks import has_comm_hook
from .state import SlimState

__all__ = ["SlimHookCallback"]


class SlimHookCallback(pl.Callback):
    """Register ``state`` on the DDP model Lightning made, and give it the optimizer.

    At ``on_fit_start``:

    - unless the DDP model has a communication hook already (Lightning registered a
      ``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=slim_hook)`` on CUDA), it registers
      ``slim_hook`` with ``state.register(ddp_model)``, which also names the parameters;
    - under torch's ``Adam`` or ``AdamW`` (the first optimizer ``configure_optimizers`` made,
      unwrapped from Lightning's), it hands it over with ``state.set_optimizer``, so each
      rank's Adam update travels, and under ``precision="16-mixed"`` the precision plugin's
      ``GradScaler`` with ``state.set_grad_scaler``. Other optimizers take the exchanged
      gradients as they are.

    Args:
        state: The ``SlimState`` of this model (one per model, as always).

    Raises:
        TypeError: ``state`` is not a ``SlimState``.
    """

    def __init__(self, state: SlimState) -> None:
        if not isinstance(state, SlimState):
            raise TypeError(f"SlimHookCallback(state): state must be a hvd_slim.ddp.SlimState, "
                            f"got {type(state).__name__}")
        self.state = state

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        ddp_model = trainer.strategy.model
        if not has_comm_hook(ddp_model):
            self.state.register(ddp_model)
        opt: Any = trainer.optimizers[0] if trainer.optimizers else None
        opt = getattr(opt, "optimizer", opt)   # LightningOptimizer's wrapped torch optimizer
        if type(opt) in (torch.optim.Adam, torch.optim.AdamW) \
                and self.state.config.adam_exchange != "update":   # not given one already
            self.state.set_optimizer(opt)
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            if scaler is not None:
                self.state.set_grad_scaler(scaler)
