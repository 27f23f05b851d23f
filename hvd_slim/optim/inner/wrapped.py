"""The wrapped optimizer's step on what the exchange delivered.

The user's optimizer steps its own parameters, except where the exchange already did part of
its work: with momentum correction the compressed parameters step without the optimizer's
momentum (the exchange applied it), and under Adam with ``adam_variance="rescaled"`` they are
stepped by :mod:`.adam` instead. A flush steps only the compressed parameters, and a stage of
``overlap_forward`` only its own, with the hyperparameters of its step.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Set

import torch

from . import adam


def step(opt: torch.optim.Optimizer, base_step: Callable[[Any], Any], closure: Any, *,
         corrected: Set[int], rescaled: Set[int], only: Optional[Set[int]] = None,
         groups: Optional[List[dict]] = None, skip: Optional[Set[int]] = None) -> Any:
    """Step ``opt`` through ``base_step`` (its own class's ``step``, bound to it).

    Args:
        corrected: ids of the parameters stepped without momentum (momentum correction).
        rescaled: ids of the parameters stepped by :func:`.adam.step` instead.
        only: when given, step only the parameters whose id is in it.
        groups: when given, one dict of hyperparameters per param group (no ``"params"``),
            used instead of the groups' current values.
        skip: ids of parameters not stepped here at all (the caller steps them: the
            update exchange of optim/inner/adam_update.py).

    Returns:
        What ``base_step(closure)`` returned.
    """
    if not corrected and not rescaled and only is None and groups is None and not skip:
        return base_step(closure)
    saved = opt.param_groups
    hyper = saved if groups is None else [{**g, **h} for g, h in zip(saved, groups)]
    view = []
    for g in hyper:
        mine = [p for p in g["params"] if (only is None or id(p) in only)
                and (skip is None or id(p) not in skip)]
        plain = [p for p in mine if id(p) not in corrected and id(p) not in rescaled]
        if plain:
            view.append({**g, "params": plain})
        stepped = [p for p in mine if id(p) in corrected]
        if stepped:
            view.append({**g, "params": stepped, "momentum": 0.0, "dampening": 0.0,
                         "nesterov": False})
    opt.param_groups = view
    try:
        out = base_step(closure)
    finally:
        opt.param_groups = saved
    for g in hyper:
        params = [p for p in g["params"] if id(p) in rescaled and (only is None or id(p) in only)]
        if params:
            adam.step(g, params, opt.state)
    return out
