"""The warm-up's slice densities, exchange step by exchange step (docs/design.md, "The warm-up").

By count (``warmup_settle=None``), a step's densities are a function of its number alone
(:meth:`SlimConfig.densities_at`). With ``warmup_settle=eta`` the warm-up ends on a measured
signal, Accordion's test for the end of a critical regime applied to what the exchange delivers:
the start densities hold while the norm of the pulled update still changes fast, and the decay
to the targets runs once it settles.

* The signal is ``||pulled update||`` of each committed exchange step (the compressed buckets'
  ``p.grad`` after the pull; under ``local_steps`` the round's global step). Every rank holds
  that update bit for bit, and computes its norm with the same operations, so every rank takes
  the same decision and no byte travels for it.
* The steps are cut into windows of :attr:`Schedule.window` steps. The hold ends after the first
  window whose mean norm is within ``eta`` (relative) of the window before; the next step starts
  a decay of ``ceil(S / 4)`` steps, S being the decay by count.
* The hold lasts at most as many steps as keep the warm-up's push densities, summed, within
  the count's (:attr:`SlimConfig.warmup_hold_limit`): it sends about as many bytes as the
  warm-up by count at most, and ends sooner (after about 0.55 S steps at the automatic 8x
  start, if it never settles).

A decision made at step ``t`` takes effect at step ``t + 1``, whose densities nobody has asked
for yet: a step's densities never change once its phases have started. The schedule's state
(the window so far, the last window's mean, where the hold ended) is part of the checkpoint.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

from ..config import SlimConfig

# Windows of about a tenth of the count's decay, and at least this many steps: the first window
# compared against the second decides at step 2 * WINDOW_MIN at the earliest.
WINDOW_MIN = 2


class Schedule:
    """The densities of each exchange step of one exchange (its layout's buckets), and, with
    ``warmup_settle``, the signal that ends the warm-up's hold."""

    def __init__(self, config: SlimConfig) -> None:
        self.cfg = config
        self.eta = config.warmup_settle
        self.window = max(WINDOW_MIN, math.ceil(config.effective_warmup_decay_steps / 10))
        # Fixed by the (frozen) config; the hold's limit sums the count's S densities, so it is
        # worked out once, not at every query of every step.
        self.hold_limit, self.decay = config.warmup_hold_limit, config.warmup_settle_decay
        self.settled_at: Optional[int] = None   # the first step of the decay (after the dense)
        self._sum, self._count, self._last = 0.0, 0, None   # type: float, int, Optional[float]

    # --- densities --------------------------------------------------------------------------
    def densities_at(self, step: int) -> Optional[Tuple[float, float]]:
        """``(push, pull)`` densities of exchange step ``step`` during the warm-up, else None
        (the targets)."""
        cfg = self.cfg
        if self.eta is None:
            return cfg.densities_at(step)
        s = step - cfg.warmup_dense_steps
        if s < 0:
            return 1.0, 1.0
        start = self.decay_start
        if s < start:
            return cfg.decay_densities(-1, self.decay)
        if s - start >= self.decay:
            return None
        return cfg.decay_densities(s - start, self.decay)

    @property
    def decay_start(self) -> int:
        """The step (counted after the dense steps) the decay starts at: where the hold ended,
        or the hold's limit while it has not."""
        return self.hold_limit if self.settled_at is None else self.settled_at

    # --- the signal -------------------------------------------------------------------------
    def observing(self, step: int) -> bool:
        """Whether :meth:`observe` wants committed step ``step``'s pulled update: only during
        the hold, so a run past it pays nothing."""
        if self.eta is None or self.settled_at is not None:
            return False
        s = step - self.cfg.warmup_dense_steps
        return 0 <= s < self.hold_limit

    def observe(self, step: int, norm: float) -> None:
        """Committed step ``step`` delivered an update of norm ``norm`` (the same on every
        rank); ends the hold after a window that settled."""
        if not self.observing(step):
            return
        self._sum += norm
        self._count += 1
        if self._count < self.window:
            return
        mean, last = self._sum / self._count, self._last
        self._sum, self._count, self._last = 0.0, 0, mean
        if last is not None and abs(mean - last) <= self.eta * last:
            self.settled_at = step - self.cfg.warmup_dense_steps + 1

    # --- checkpoint -------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"settled_at": self.settled_at, "sum": self._sum, "count": self._count,
                "last": self._last}

    @staticmethod
    def check_state(state: Any) -> None:
        """Raise ValueError unless ``state`` is what :meth:`state_dict` makes."""
        if not isinstance(state, dict) or set(state) != {"settled_at", "sum", "count", "last"}:
            raise ValueError(f"hvd_slim checkpoint: the warm-up's state must be a dict of "
                             f"settled_at, sum, count and last, got {state!r}")
        ok = (state["settled_at"] is None or isinstance(state["settled_at"], int)) and \
            isinstance(state["sum"], float) and isinstance(state["count"], int) and \
            (state["last"] is None or isinstance(state["last"], float))
        if not ok:
            raise ValueError(f"hvd_slim checkpoint: the warm-up's state has a value of the "
                             f"wrong type: {state!r}")

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.check_state(state)
        self.settled_at, self._sum = state["settled_at"], state["sum"]
        self._count, self._last = state["count"], state["last"]
