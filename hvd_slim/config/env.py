"""``HVD_SLIM_<NAME>`` environment variables: how each is parsed, and the config they resolve.

A keyword passed to ``DistributedOptimizer`` beats its variable; a variable beats the field's
default. A value that does not parse, or that the config refuses, is reported with the
variable's name, so a user can tell a bad environment from a bad argument.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional

from .settings import ENV_KEYWORDS, ENV_PREFIX, ConfigError, SlimConfig

__all__ = ["ENV_KEYWORDS", "resolve_config"]


def _parse_env(name: str, text: str) -> Any:
    """Parse HVD_SLIM_<NAME> by the field's type; errors name the variable."""
    var = ENV_PREFIX + name.upper()
    t = text.strip()
    try:
        if name in ("pull", "nonfinite", "adam_variance", "adam_exchange", "sparse_average"):
            return t.lower()
        if name == "timeout" and t.lower() in ("none", "off", "never", ""):
            return None
        if name == "momentum_correction" and t.lower() in ("auto", "none", ""):
            return None
        flags = {"1": True, "true": True, "yes": True, "on": True,
                 "0": False, "false": False, "no": False, "off": False}
        if name == "momentum_masking" and t.lower() in flags:
            return flags[t.lower()]
        if name == "overlap" and t.lower() in flags and not t.isdigit():
            return flags[t.lower()]   # a number is a stage count, as for the keyword
        if name in ("momentum_correction", "hierarchical", "overlap_forward"):
            if t.lower() not in flags:
                raise ValueError(f"{t!r} is none of these")
            return flags[t.lower()]
        if name in ("pull_density", "warmup_start_density", "warmup_decay_steps",
                    "pull_value_bits", "warmup_settle") \
                and t.lower() in ("none", "auto", ""):
            return None
        if name == "servers" and t.lower() == "auto":
            return "auto"
        if name in _INT_FIELDS:
            try:
                return int(t)
            except ValueError:
                x = float(t)          # "1e3" or "4.0" is an integer too; "2.5" is not
                if not x.is_integer():
                    raise ValueError(f"{t!r} is not an integer") from None
                return int(x)
        return float(t)
    except ValueError as exc:
        raise ConfigError(f"environment variable {var}={text!r} is not a valid value for "
                          f"{name} ({_ENV_FORMS.get(name, 'a number')}): {exc}", name) from None


_INT_FIELDS = ("min_compress_numel", "server_rank", "seed", "servers",
               "overlap", "local_steps", "outer_delay", "warmup_dense_steps",
               "warmup_decay_steps", "value_bits", "pull_value_bits")
# What each variable accepts, for parse errors.
_ENV_FORMS = {"momentum_correction": "true, false or auto", "pull_density": "a number in (0, 1] "
              "or none", "min_compress_numel":
              "an integer >= 0", "server_rank": "an integer rank", "seed": "an integer >= 0",
              "timeout": "seconds > 0, or 0/none to wait forever", "density": "a number in (0, 1]",
              "exploration": "a number in [0, 1]", "magnitude_weight": "a number >= 0",
              "warmup_dense_steps": "an integer >= 0",
              "warmup_decay_steps": "an integer >= 0 or auto",
              "warmup_start_density": "a number in (0, 1] or auto",
              "warmup_settle": "a number in (0, 1], or none to decay by count",
              "value_bits": "one of 1, 2, 4, 8, 16 or 32",
              "pull_value_bits": "one of 1, 2, 4, 8, 16 or 32, or auto",
              "adam_variance": "auto, rescaled or live",
              "adam_exchange": "auto, update or gradient",
              "sparse_average": "ranks or senders",
              "momentum_masking": "true, false or a number in [0, 1]",
              "servers": "an integer >= 1 or auto", "hierarchical": "true or false",
              "overlap_forward": "true or false",
              "overlap": "true, false or an integer number of stages >= 1",
              "local_steps": "an integer >= 1", "outer_delay": "an integer, 0 or 1",
              "residual_decay": "a number in (0, 1]"}


# Keywords hvd_slim no longer has: a leftover variable is refused, not silently ignored.
RETIRED = {"refresh_interval": "a core kept for several steps diverged or lost accuracy, "
                               "docs/keywords.md; every step selects anew"}


def resolve_config(explicit: Mapping[str, Any], environ: Optional[Mapping[str, str]] = None
                   ) -> SlimConfig:
    """Build a config from explicitly passed keywords, then ``HVD_SLIM_*`` variables, then defaults.

    A validation error caused by a value from the environment names the variable.
    """
    environ = os.environ if environ is None else environ
    for name, why in RETIRED.items():
        var = ENV_PREFIX + name.upper()
        if var in environ:
            raise ConfigError(f"environment variable {var} is set, but {name} was removed from "
                              f"hvd_slim ({why}); unset it", name)
    values: Dict[str, Any] = {}
    from_env: Dict[str, str] = {}
    for name in ENV_KEYWORDS:
        if name in explicit:
            continue
        var = ENV_PREFIX + name.upper()
        if var in environ:
            values[name] = _parse_env(name, environ[var])
            from_env[name] = var
    values.update(explicit)
    try:
        config = SlimConfig(**values)
    except ConfigError as exc:
        if exc.field in from_env:
            raise ConfigError(f"{exc} (from environment variable {from_env[exc.field]})",
                              exc.field) from None
        raise
    # Remembered (outside the dataclass fields, so not in the digest) for later checks that
    # need the world size or the optimizer, so their errors can name the variable too.
    object.__setattr__(config, "_env_sources", dict(from_env))
    # Which keywords the user set (passed or from a variable): the rest may take the defaults
    # of the mode the optimizer resolves to (SlimConfig.update_defaults).
    object.__setattr__(config, "_given", frozenset(explicit) | frozenset(from_env))
    return config.replaced(**config.sign_defaults())   # value_bits=1: every coordinate's sign
