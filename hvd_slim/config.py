"""Slim-DP configuration: one frozen, validated dataclass.

Every Slim-DP keyword of :func:`hvd_slim.DistributedOptimizer` lands here. A keyword the caller
does not pass takes its default from the environment variable ``HVD_SLIM_<NAME>`` (so an
unchanged script can be re-run at another density), and otherwise from the field default below.
Bad values and bad combinations are rejected at construction, with the argument (or variable)
named. The config is plain data: ``to_dict()`` checkpoints it without the communicator.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping, Optional

PULL_MODES = ("slim", "union")
OPS = ("average", "sum")
ENV_PREFIX = "HVD_SLIM_"
# Keywords that may come from HVD_SLIM_<NAME>; the Horovod ones (op, ...) are always explicit.
ENV_KEYWORDS = ("density", "exploration", "refresh_interval", "magnitude_weight",
                "momentum_correction", "pull", "pull_density", "min_compress_numel",
                "server_rank", "seed")


class ConfigError(ValueError):
    """A Slim-DP keyword is out of range or conflicts with another one."""


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_fraction(name: str, value: Any, low_open: bool) -> None:
    if not _is_number(value) or math.isnan(value):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    lo_ok = value > 0 if low_open else value >= 0
    if not lo_ok or value > 1:
        rng = "(0, 1]" if low_open else "[0, 1]"
        raise ConfigError(f"{name} must be in {rng}, got {value!r}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class SlimConfig:
    """Validated Slim-DP settings (see DESIGN §2 for what each one does)."""

    # --- slice sizes -------------------------------------------------------------------------
    density: float = 0.01              # k/d: fraction of compressed coordinates a worker pushes
    pull_density: Optional[float] = None  # k_pull/d for pull="slim"; None means "= density"
    min_compress_numel: int = 4096     # tensors smaller than this are fused and sent dense
    # --- selection ---------------------------------------------------------------------------
    exploration: float = 0.1           # epsilon: share of each slice given to random exploration
    magnitude_weight: float = 0.0      # lambda in |a| + lambda*|w|; 0 = gradient magnitude only
    refresh_interval: int = 1          # q: re-select the core every q steps (q > 1 is expert-only)
    # --- memory ------------------------------------------------------------------------------
    momentum_correction: Optional[bool] = None  # None = on for SGD with momentum > 0
    # --- server and reduction ----------------------------------------------------------------
    pull: str = "slim"                 # "slim": server keeps a residual; "union": exact union
    server_rank: int = 0               # rank that aggregates pushes (it is also a worker)
    op: str = "average"                # "average" or "sum" of the workers' contributions
    gradient_predivide_factor: float = 1.0  # Horovod's: scale by 1/f before, f/N after (average)
    backward_passes_per_step: int = 1  # local backward passes accumulated per exchange
    # --- randomness --------------------------------------------------------------------------
    seed: int = 0                      # keys every replica's exploration generator

    def __post_init__(self) -> None:
        _check_fraction("density", self.density, low_open=True)
        if self.pull_density is not None:
            _check_fraction("pull_density", self.pull_density, low_open=True)
        _check_fraction("exploration", self.exploration, low_open=False)
        if not _is_number(self.magnitude_weight) or not math.isfinite(self.magnitude_weight) \
                or self.magnitude_weight < 0:
            raise ConfigError(f"magnitude_weight must be a finite number >= 0, "
                              f"got {self.magnitude_weight!r}")
        _check_int("refresh_interval", self.refresh_interval, 1)
        _check_int("min_compress_numel", self.min_compress_numel, 0)
        _check_int("server_rank", self.server_rank, 0)
        _check_int("backward_passes_per_step", self.backward_passes_per_step, 1)
        _check_int("seed", self.seed, 0)
        if self.momentum_correction not in (None, True, False):
            raise ConfigError(f"momentum_correction must be True, False or None (auto), "
                              f"got {self.momentum_correction!r}")
        if self.pull not in PULL_MODES:
            raise ConfigError(f"pull must be one of {PULL_MODES}, got {self.pull!r}")
        if self.op not in OPS:
            raise ConfigError(f"op must be one of {OPS}, got {self.op!r}")
        f = self.gradient_predivide_factor
        if not _is_number(f) or not math.isfinite(f) or f <= 0:
            raise ConfigError(f"gradient_predivide_factor must be a finite number > 0, got {f!r}")
        if f != 1.0 and self.op != "average":
            raise ConfigError("gradient_predivide_factor not supported with op != Average: "
                              "use op=hvd.Average or leave the factor at 1.0")

    # --- derived -------------------------------------------------------------------------------
    @property
    def effective_pull_density(self) -> float:
        return self.density if self.pull_density is None else self.pull_density

    def check_world(self, size: int) -> None:
        """Checks that need the world size: the server must be one of the ranks."""
        if not 0 <= self.server_rank < size:
            raise ConfigError(f"server_rank must be in [0, {size}) for a job of {size} ranks, "
                              f"got {self.server_rank}")

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """A short hash of every field, equal on ranks that agree on the config."""
        text = repr(sorted(self.to_dict().items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SlimConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown Slim-DP config keys {sorted(unknown)}")
        return cls(**dict(d))


def _parse_env(name: str, text: str) -> Any:
    """Parse HVD_SLIM_<NAME> by the field's type; errors name the variable."""
    var = ENV_PREFIX + name.upper()
    t = text.strip()
    try:
        if name == "pull":
            return t
        if name == "momentum_correction":
            low = t.lower()
            if low in ("auto", "none", ""):
                return None
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true/false/auto")
        if name == "pull_density" and t.lower() in ("none", ""):
            return None
        if name in ("refresh_interval", "min_compress_numel", "server_rank", "seed"):
            return int(t)
        return float(t)
    except ValueError as exc:
        raise ConfigError(f"environment variable {var}={text!r} is not a valid value for "
                          f"{name}: {exc}") from None


def resolve_config(explicit: Mapping[str, Any], environ: Optional[Mapping[str, str]] = None
                   ) -> SlimConfig:
    """Build a config from explicitly passed keywords, then ``HVD_SLIM_*`` variables, then defaults.

    A validation error caused by a value from the environment names the variable.
    """
    environ = os.environ if environ is None else environ
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
        return SlimConfig(**values)
    except ConfigError as exc:
        msg = str(exc)
        for name, var in from_env.items():
            if msg.startswith(name + " "):
                raise ConfigError(f"{msg} (from environment variable {var})") from None
        raise
