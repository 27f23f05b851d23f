"""How a step ends once every rank has its verdict: committed, or skipped by every rank (a
NaN/Inf under ``nonfinite="flag"`` or ``"skip"``), in which case nothing of the exchange
changes, the skip is counted, and under ``"flag"`` every gradient becomes NaN (so that
``GradScaler`` backs off). The flat and hosts-first exchanges end a step with :func:`finish`;
the staged one (exchange/overlap/staged.py), which drops its stages together, with
:func:`skipped`."""
from __future__ import annotations

from typing import Any, Callable

from .protocol import Stage


def finish(ex: Stage, pending: Any) -> bool:
    """Settle ``pending`` (what ``ex.begin()`` returned): commit it and return True, or, when
    every rank skipped it (``pending.pulled`` None), drop it exactly and return
    :func:`skipped`'s False."""
    if pending.pulled is None:
        ex.settle(pending, commit=False)
        return skipped(ex.stats, ex.cfg.nonfinite, ex.flag_grads)
    ex.settle(pending, commit=True)
    return True


def skipped(stats: Any, nonfinite: str, flag_grads: Callable[[], None]) -> bool:
    """A step every rank skipped, already dropped: counted in ``stats``, and under
    ``nonfinite="flag"`` every gradient set to NaN by ``flag_grads``. Returns False, what
    ``step()`` returns for it."""
    stats.skipped_steps += 1
    if nonfinite == "flag":
        flag_grads()
    return False
