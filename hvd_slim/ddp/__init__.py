"""Slim-DP as a DDP communication hook::

    from hvd_slim.ddp import SlimState, slim_hook
    ddp_model.register_comm_hook(SlimState(), slim_hook)
    state = SlimState().register(ddp_model)   # the same, with the model and its group checked

One added line for a ``torchrun`` + ``DistributedDataParallel`` script, or for Lightning's
``DDPStrategy(ddp_comm_state=SlimState(), ddp_comm_hook=slim_hook)``. See ``SlimState``.

Rounds of local steps (level with dense DDP on an AdamW transformer at 1,199x fewer pushed
bytes) need the optimizer: ``opt = local_optimizer(ddp_model, optimizer, local_steps=4)``.
"""
from .hook import local_hook, slim_hook
from .local import local_optimizer
from .state import SlimState

__all__ = ["SlimState", "local_hook", "local_optimizer", "slim_hook"]
