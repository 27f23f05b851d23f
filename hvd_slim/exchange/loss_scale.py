"""The loss scale of the gradients an exchange reads: a ``torch.amp.GradScaler``'s, once the
optimizer (``set_grad_scaler``) or the DDP hook's state was told of it.

In Horovod's AMP order the exchange runs before ``scaler.unscale_``, on *scaled* gradients.
Told the scale, the exchange keeps its compressed buckets in the gradients' true units: it takes
each rank's gradient divided by the scale and writes what it pulled back multiplied by it, where
the script's ``unscale_`` divides it out again. Both are exact, the scale being a power of two.
So residuals and velocities never mix two scales when the scaler grows or backs off, a
``flush()`` hands true units to the optimizer step it runs, and a run is bitwise the run without
a scaler. A host's carry under ``hierarchical=True`` (a failed step's gradient that no host
reduction took in yet) is kept in true units too (exchange/hosts/phases.py), since the scale may
change before a later step takes it in. Dense buckets keep the scale: they hold nothing between
steps. Under Adam's update
exchange the moments take the scale out before the exchange (optim/inner/adam_update.py), so the
exchange is not told then.
"""
from __future__ import annotations

from typing import Any

import torch

# XORed into the handshake's digest of a rank whose exchange was told a scale: ranks that
# disagree would keep their residuals in other units, and write their pulls at other scales.
TOLD_BIT = 1 << 63


class LossScale:
    """Whether, and by which ``torch.amp.GradScaler``, the gradients are scaled; shared by a
    layout and the layouts cut from it (overlap's stages, a host leader's pieces)."""

    def __init__(self) -> None:
        self.scaler: Any = None
        self._seen: Any = None    # (the scale tensor, its version) last read
        self._value = 1.0

    @property
    def told(self) -> bool:
        return self.scaler is not None

    def give(self, scaler: Any, begun: bool, where: str, before: str) -> None:
        """Take ``scaler`` (None: none). Once the residuals hold something (``begun``), one
        scaler may replace another, but going from none to one or back is refused: the
        residuals are in true units with one, at the loss scale without. ``where`` names the
        call, ``before`` what it must come before."""
        if begun and (scaler is None) != (self.scaler is None):
            raise RuntimeError(f"{where}: a GradScaler can be given or taken away only before "
                               f"{before}: the residuals are kept in true units when one is "
                               f"given, at the loss scale otherwise")
        self.scaler = scaler

    def check_resumed(self, saved: Any, where: str, owner: str) -> None:
        """ValueError unless a checkpoint that was saved with a scaler given (``saved``) is
        loaded with one, and one saved without, without. ``where`` begins the message;
        ``owner`` is what the script calls ``set_grad_scaler`` on."""
        if bool(saved) == self.told:
            return
        how, units, now = ("with", "true units", "none") if saved else \
            ("without", "the loss scale's", "one")
        raise ValueError(f"{where} was saved {how} a GradScaler given to set_grad_scaler() (its "
                         f"residuals in {units}); this {owner} has {now}. Call "
                         f"{owner}.set_grad_scaler(scaler) before load_state_dict() as the "
                         f"saving run did, or leave it out alike")

    def read(self) -> float:
        """The scale in this step's gradients (1.0 untold). Every exchange of a step reads it
        (each of the DDP hook's buckets, each of overlap's stages), and on CUDA a read waits for
        the GPU: the value is kept until the scaler's scale tensor changes (its in-place
        update bumps the tensor's version)."""
        scaler = self.scaler
        if scaler is None:
            return 1.0
        t = scaler._get_scale_async() if scaler.is_enabled() else None
        if t is None:
            return loss_scale(scaler)
        if self._seen is None or self._seen[0] is not t or self._seen[1] != t._version:
            self._seen, self._value = (t, t._version), loss_scale(scaler)
        return self._value


def checked_scaler(scaler: Any, where: str) -> Any:
    """``scaler`` if it is a ``torch.amp.GradScaler`` or None; TypeError naming ``where``."""
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"{where}: scaler must be a torch.amp.GradScaler (or None), got "
                        f"{type(scaler).__name__}")
    return scaler


def loss_scale(scaler: Any) -> float:
    """The scale ``scaler`` (a GradScaler, or None: 1) leaves in this backward's gradients: a
    power of two, so dividing by it is exact. One host read a pass on CUDA."""
    return 1.0 if scaler is None else float(scaler.get_scale())
