"""Rounds of local steps for a DDP model: ``local_optimizer(ddp_model, optimizer, local_steps=H)``.

Local steps need the optimizer, not a gradient hook: between rounds each rank steps alone on its
own gradients, and at a round's end its parameter change since the round began travels through
the Slim-DP exchange (outer/rounds.py). So the optimizer is wrapped by
``hvd_slim.DistributedOptimizer(local_steps=H)``, which does exactly that, on a private process
group over the DDP model's ranks; DDP's own allreduce is replaced by :func:`local_hook`, which
leaves each rank's gradient as it is (no communication in backward). The two are made together
here, so one never runs without the other: DDP averaging every step would spend a dense
allreduce per step under the rounds, and a hook that keeps gradients local with an optimizer
that never exchanges would let the replicas drift apart for good.

On the AdamW transformer of the fair horizon, ``local_steps=4`` ends level with dense DDP at
1,199x fewer pushed bytes (docs/accuracy.md); the model's parameters are each rank's own between
round ends, and the same on every rank bitwise at each round's end.
"""
from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..config import ENV_KEYWORDS, ConfigError
from ..config.env import resolve_config
from ..optim.distributed_optimizer import DistributedOptimizer
from .checks import has_comm_hook
from .group import group_transport
from .hook import local_hook

# What local_optimizer() sets itself: the parameters' names, and the exchange's process group.
_OWN = ("named_parameters", "transport", "process_set")


def local_optimizer(ddp_model: Any, optimizer: torch.optim.Optimizer,
                    **keywords: Any) -> torch.optim.Optimizer:
    """Train ``ddp_model`` in rounds of local steps: wrap ``optimizer`` in
    ``hvd_slim.DistributedOptimizer(local_steps=H)`` over the DDP model's ranks and register
    :func:`local_hook` on the model, so backward communicates nothing and each round's end
    exchanges its pseudo-gradient with Slim-DP::

        ddp = DistributedDataParallel(model)
        opt = hvd_slim.ddp.local_optimizer(ddp, torch.optim.AdamW(ddp.parameters()), local_steps=4)

    Use the returned optimizer (``step()``, ``zero_grad()``, ``state_dict()``), as with
    Horovod's ``DistributedOptimizer``. Call it on every rank alike, before the first backward
    pass: it makes a process group (collective).

    Args:
        ddp_model: A ``torch.nn.parallel.DistributedDataParallel`` model with no communication
            hook registered yet, on a Gloo (CPU) or NCCL (CUDA) process group.
        optimizer: Any ``torch.optim.Optimizer`` over the DDP model's parameters; it steps
            alone between rounds.
        **keywords: The Slim-DP keywords of ``hvd_slim.DistributedOptimizer``, each read from
            ``HVD_SLIM_<NAME>`` when not passed. ``local_steps`` (or ``HVD_SLIM_LOCAL_STEPS``)
            must come to more than 1; ``outer_optimizer``, ``outer_delay`` and the exchange's
            keywords (``density``, ``value_bits``, ...) apply as there, and so do Horovod's:
            accumulating gradients over K backward passes (``no_sync()``) takes
            ``backward_passes_per_step=K``. The parameters' names, the transport and the
            process set are this function's own.

    Returns:
        The wrapped optimizer (an instance of ``optimizer``'s class, as Horovod's).

    Raises:
        TypeError: ``ddp_model`` is not a DistributedDataParallel model; a keyword is unknown
            or one this function sets.
        ConfigError: (a ValueError) ``local_steps`` comes to 1 (naming its variable when it
            came from one), or another value ``DistributedOptimizer`` refuses.
        RuntimeError: torch.distributed is not initialised, or the DDP model has a
            communication hook already.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"local_optimizer: ddp_model must be a torch.nn.parallel."
                        f"DistributedDataParallel model, got {type(ddp_model).__name__}; wrap "
                        f"the module in DistributedDataParallel first")
    own = sorted(set(keywords) & set(_OWN))
    if own:
        raise TypeError(f"local_optimizer() sets {', '.join(own)} itself (the DDP model's "
                        f"parameter names and process group); leave them out")
    unknown = sorted(set(keywords) - set(inspect.signature(DistributedOptimizer).parameters))
    if unknown:
        raise TypeError(f"local_optimizer() got unexpected keyword(s) {', '.join(unknown)}; it "
                        f"takes hvd_slim.DistributedOptimizer's (docs/keywords.md)")
    config = resolve_config({k: v for k, v in keywords.items() if k in ENV_KEYWORDS})
    if config.local_steps <= 1:
        raise ConfigError(f"local_optimizer: local_steps={config.local_steps}"
                          f"{config.env_note('local_steps')} leaves no local steps; give "
                          f"local_steps=H (H > 1, 4 for a transformer over slow links) or "
                          f"HVD_SLIM_LOCAL_STEPS, or use SlimState() and slim_hook to exchange "
                          f"every step", "local_steps")
    if has_comm_hook(ddp_model):
        raise RuntimeError("local_optimizer: this DDP model has a communication hook already; "
                           "build local_optimizer on a DDP model without one (it registers "
                           "its own, which keeps gradients local)")
    device = next((p.device for p in ddp_model.parameters()), torch.device("cpu"))
    # DDP's default group: a private one over the same ranks (None), as SlimState makes, so the
    # rounds' exchanges never share a group with DDP's own collectives.
    group = ddp_model.process_group
    transport, _ = group_transport(None if group is dist.group.WORLD else group, device)
    try:
        opt = DistributedOptimizer(optimizer, named_parameters=ddp_model.module.named_parameters(),
                                   transport=transport, **keywords)
        ddp_model.register_comm_hook(opt, local_hook)
    except BaseException:
        transport.close()
        raise
    # The private group goes with the optimizer, or at exit while Python still runs, before
    # the interpreter's teardown, where Gloo's threads can abort a process that leaves its
    # groups to it (docs/ddp.md, "Teardown"). A script's destroy_process_group() takes it too.
    weakref.finalize(opt, transport.close)
    return opt
