"""The checks of single Slim-DP keywords (and of the pairs that must agree), apart from the
dataclass that runs them (config/settings.py): each returns the normalised value or raises
:class:`ConfigError` naming the keyword and what it accepts."""
from __future__ import annotations

import math
import numbers
from typing import Any, Dict, Optional

# overlap=True: stages per step. Each stage is one more gather and broadcast per step (a round
# trip of latency), so a few suffice to hide most of an exchange behind backward.
OVERLAP_STAGES = 4
# outer_delay: the rounds an outer step may land late (local_steps > 1).
OUTER_DELAYS = (0, 1)


class ConfigError(ValueError):
    """A Slim-DP keyword is out of range or conflicts with another one. ``field`` names it."""

    def __init__(self, message: str, field: Optional[str] = None) -> None:
        super().__init__(message)
        self.field = field


def _is_number(x: Any) -> bool:
    # numbers.Real admits numpy scalars (np.float32 is not a float subclass); bool is excluded.
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_fraction(name: str, value: Any, low_open: bool) -> float:
    rng = "(0, 1]" if low_open else "[0, 1]"
    if not _is_number(value) or math.isnan(value):
        raise ConfigError(f"{name} must be a number in {rng}, got {value!r}", name)
    lo_ok = value > 0 if low_open else value >= 0
    if not lo_ok or value > 1:
        raise ConfigError(f"{name} must be in {rng}, got {value!r}", name)
    return float(value)


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}", name)
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value!r}", name)
    return int(value)


def _check_overlap(value: Any) -> int:
    """``overlap``: True (OVERLAP_STAGES), False (1) or an integer number of stages >= 1."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return OVERLAP_STAGES if value else 1
    if not isinstance(value, numbers.Integral):
        raise ConfigError(f"overlap must be True, False or an integer number of stages >= 1, "
                          f"got {value!r}", "overlap")
    return _check_int("overlap", value, 1)


def _check_overlap_forward(value: Any, overlap: int) -> bool:
    """``overlap_forward``: True or False, and True only with stages to order."""
    if not isinstance(value, bool) and type(value).__name__ != "bool_":
        raise ConfigError(f"overlap_forward must be True or False, got {value!r}",
                          "overlap_forward")
    if value and overlap <= 1:
        raise ConfigError(f"overlap_forward=True needs overlap > 1 (overlap={overlap}): it "
                          "orders the stages of an overlapped exchange. Pass overlap=True too",
                          "overlap_forward")
    return bool(value)


def _check_outer_delay(value: Any, local_steps: int) -> int:
    """``outer_delay``: 0 or 1 round, and 1 only with local steps to overlap."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or \
            value not in OUTER_DELAYS:
        raise ConfigError(f"outer_delay must be one of {OUTER_DELAYS} (rounds the outer step "
                          f"lands late), got {value!r}", "outer_delay")
    if value and local_steps <= 1:
        raise ConfigError(f"outer_delay=1 needs local_steps > 1 (local_steps={local_steps}): "
                          "it overlaps a round's exchange with the next round's local steps",
                          "outer_delay")
    return int(value)


def _check_local_steps(norm: Dict[str, Any], momentum_correction: Any) -> None:
    """What ``local_steps > 1`` cannot be combined with (the exchange then carries a
    pseudo-gradient once a round, to the outer optimizer)."""
    if norm["overlap"] > 1:
        raise ConfigError("local_steps > 1 cannot be combined with overlap > 1: a round's "
                          "exchange starts after its last local step, not in backward. Pass one "
                          "of them", "local_steps")
    if norm["hierarchical"]:
        raise ConfigError("local_steps > 1 cannot be combined with hierarchical=True yet: pass "
                          "one of them", "local_steps")
    if momentum_correction is True:
        raise ConfigError("momentum_correction=True cannot be combined with local_steps > 1: "
                          "the outer optimizer's own momentum runs on the averaged "
                          "pseudo-gradient. Leave it unset (auto: off) or False",
                          "momentum_correction")


def _check_timeout(value: Any) -> Optional[float]:
    """None or 0 disable the exchange timeout; otherwise a finite number of seconds > 0."""
    if value is None:
        return None
    if not _is_number(value) or math.isnan(value) or value < 0 or math.isinf(value):
        raise ConfigError(f"timeout must be a number of seconds > 0, or 0/None to wait forever, "
                          f"got {value!r}", "timeout")
    return None if value == 0 else float(value)
