"""Slim-DP as a DDP communication hook::

    from hvd_slim.ddp import SlimState, slim_hook
    ddp_model.register_comm_hook(SlimState(), slim_hook)
    state = SlimState().register(ddp_model)   # the same, with the model and its group checked

One added line for a ``torchrun`` + ``DistributedDataParallel`` script, or for Lightning's
``DDPStrategy(ddp_comm_state=SlimState(), ddp_comm_hook=slim_hook)``. See ``SlimState``.
"""
from .hook import slim_hook
from .state import SlimState

__all__ = ["SlimState", "slim_hook"]
