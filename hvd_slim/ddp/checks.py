"""What ``SlimState`` accepts: the Slim-DP keywords a gradient hook can serve, and checkpoints of
its own earlier formats refused by name."""
from __future__ import annotations

from typing import Any, Mapping, Optional

from ..config import ENV_KEYWORDS, ConfigError, SlimConfig

# Each keyword the hook cannot serve, and why; checked on the resolved settings, so a value from
# HVD_SLIM_<NAME> is named with its variable.
NEEDS_OPTIMIZER = {
    "local_steps": ("1", lambda c: c.local_steps == 1,
                    "local steps need the optimizer, which steps alone between rounds: "
                    "hvd_slim.ddp.local_optimizer(ddp_model, optimizer, local_steps=H) wraps "
                    "it and registers a hook that keeps gradients local"),
    "outer_delay": ("0", lambda c: c.outer_delay == 0, "it belongs to local_steps"),
    "overlap": ("1", lambda c: c.overlap == 1,
                "DDP's buckets already overlap the exchange with backward"),
    "overlap_forward": ("False", lambda c: not c.overlap_forward, "it belongs to overlap"),
    "hierarchical": ("False", lambda c: not c.hierarchical,
                     "the hook does not combine a host's ranks first yet"),
    "momentum_correction": ("None or False", lambda c: c.momentum_correction is not True,
                            "the hook sees gradients, not the optimizer's momentum"),
    "adam_exchange": ("'auto' or 'gradient'", lambda c: c.adam_exchange != "update",
                      "the hook sees gradients: pass optimizer= (torch's Adam or AdamW) for "
                      "Adam's update"),
    "magnitude_weight": ("0", lambda c: c.magnitude_weight == 0,
                         "the hook sees gradients, not the parameters"),
    "sparse_average": ("'ranks'", lambda c: c.sparse_average == "ranks",
                       "DDP's re-bucketing hands what the server holds back to the ranks, "
                       "which only an average over every rank conserves"),
}
HOOK_KEYWORDS = frozenset(ENV_KEYWORDS)


def check_keywords(keywords: Mapping[str, Any], config: Optional[SlimConfig] = None,
                   update: bool = False) -> None:
    """Unknown keywords (TypeError), then, given the resolved ``config``, the values a DDP hook
    cannot serve (ConfigError naming the keyword or its variable, and what to use instead).
    ``update``: an optimizer was given, so Adam's update travels (not with
    ``adam_exchange="gradient"``)."""
    unknown = sorted(set(keywords) - HOOK_KEYWORDS)
    if unknown:
        raise TypeError(f"SlimState() got unexpected keyword(s) {', '.join(unknown)}; it takes "
                        f"process_group, optimizer, named_parameters and the Slim-DP keywords of "
                        f"hvd_slim.DistributedOptimizer (docs/keywords.md)")
    if config is None:
        return
    if update and config.adam_exchange == "gradient":
        raise ConfigError(f"SlimState: optimizer= exchanges Adam's update, but adam_exchange="
                          f"'gradient'{config.env_note('adam_exchange')}; leave it 'auto', or "
                          f"drop optimizer= to exchange gradients", "adam_exchange")
    for name, (allowed, ok, why) in NEEDS_OPTIMIZER.items():
        if update and name == "adam_exchange":
            continue
        if not ok(config):
            raise ConfigError(f"SlimState: {name}={getattr(config, name)!r}"
                              f"{config.env_note(name)} cannot be served by a DDP hook ({why}); "
                              f"leave it at {allowed} here, or use hvd_slim.DistributedOptimizer",
                              name)


def refuse_old_format(state: Any, field: str, old: int, what: str, then: str, now: str) -> None:
    """Refuse a checkpoint ``state`` whose ``field`` says format ``old``: ``what`` it is, what
    the hvd_slim that wrote it did (``then``) and what this one does (``now``)."""
    if isinstance(state, dict) and state.get(field) == old:
        raise ValueError(f"hvd_slim.ddp: this {what} is format {old}, from an hvd_slim whose "
                         f"{then}; this one {now} and cannot resume it. Start the hook from a "
                         f"fresh SlimState (the model and optimizer checkpoints still load)")


def has_comm_hook(ddp_model: Any) -> bool:
    """Whether ``ddp_model`` (a DistributedDataParallel model) has a Python communication hook
    registered already (DDP keeps them in ``_comm_hooks``; a built-in one is refused by DDP's
    own registration)."""
    return bool(getattr(ddp_model, "_comm_hooks", None))
