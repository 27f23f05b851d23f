"""Residual (error-feedback) memory with optional momentum correction, for workers and the server.

A worker's memory holds ``r``, everything it computed but has not sent, and, with momentum
correction, ``u``, its local velocity. One step is ``compensate`` (fold the new gradient in and
return what is available to send) followed by ``update`` (forget what was sent). The server uses
the same class without momentum for its own residual ``e``.

The exchange uses the speculative pair instead: ``propose`` computes the same ``a`` (and the new
velocity) without touching the memory, and ``commit`` adopts them once every rank agreed on the
step. A step that every rank skips (a NaN/Inf gradient somewhere) is simply never committed, so
no residual ever absorbs a non-finite value and nothing changes. Bitwise, propose + commit equals
compensate + update.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch


class ResidualMemory:
    """Error feedback over one flat buffer of ``numel`` coordinates.

    With ``momentum > 0`` (momentum correction, DGC-style):
    ``u = m*u + (1-dampening)*g``; ``a = r + u`` (nesterov: ``a = r + g + m*u``).
    Without: ``a = r + g``. ``update`` sets ``r = a`` minus what was delivered at the sent
    coordinates and masks ``u`` there (momentum factor masking).
    """

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", momentum: float = 0.0,
                 dampening: float = 0.0, nesterov: bool = False) -> None:
        if momentum < 0:
            raise ValueError(f"momentum must be >= 0, got {momentum}")
        self.momentum = float(momentum)
        self.dampening = float(dampening)
        self.nesterov = bool(nesterov)
        # ``residual`` doubles as the accumulator: after compensate it holds a = r + u.
        self.residual = torch.zeros(numel, dtype=dtype, device=device)
        self.velocity: Optional[torch.Tensor] = (
            torch.zeros(numel, dtype=dtype, device=device) if self.momentum > 0 else None)
        # The proposed velocity of the step in flight (momentum only); swapped in by commit.
        self._next_velocity: Optional[torch.Tensor] = (
            torch.zeros(numel, dtype=dtype, device=device) if self.momentum > 0 else None)

    @property
    def numel(self) -> int:
        return self.residual.numel()

    def compensate(self, grad: torch.Tensor) -> torch.Tensor:
        """Fold ``grad`` into the memory and return ``a``, the values available to send.

        The returned tensor is the memory's own buffer: ``update`` must follow before the next
        ``compensate``.
        """
        if grad.shape != self.residual.shape:
            raise ValueError(f"gradient of shape {tuple(grad.shape)} does not match the memory's "
                             f"{tuple(self.residual.shape)}")
        if self.velocity is None:
            return self.residual.add_(grad)
        u = self.velocity
        u.mul_(self.momentum).add_(grad, alpha=1.0 - self.dampening)
        if self.nesterov:
            self.residual.add_(grad).add_(u, alpha=self.momentum)
        else:
            self.residual.add_(u)
        return self.residual

    def propose(self, grad: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Return ``(a, u_new)`` for ``grad`` without changing the memory.

        ``a`` is computed in place in ``grad``'s buffer (which the caller hands over); ``u_new``
        (None without momentum) lives in a buffer the memory keeps for this purpose. Pass both
        to :meth:`commit`, or drop them to leave the memory as it was.
        """
        if grad.shape != self.residual.shape:
            raise ValueError(f"gradient of shape {tuple(grad.shape)} does not match the memory's "
                             f"{tuple(self.residual.shape)}")
        if self.velocity is None:
            return grad.add_(self.residual), None   # g + r: the same bits as r + g
        u_new = torch.mul(self.velocity, self.momentum, out=self._next_velocity)
        u_new.add_(grad, alpha=1.0 - self.dampening)
        if self.nesterov:
            return grad.add_(self.residual).add_(u_new, alpha=self.momentum), u_new
        return torch.add(self.residual, u_new, out=grad), u_new

    def commit(self, a: torch.Tensor, u_new: Optional[torch.Tensor],
               sent: Optional[torch.Tensor], delivered: Optional[torch.Tensor] = None,
               mask_velocity: bool = True) -> torch.Tensor:
        """Adopt a proposal: ``r = a`` and ``u = u_new``, then forget ``sent`` as :meth:`update`
        does (an empty ``sent`` keeps everything: a failed step loses nothing). Returns the old
        residual buffer, which the caller may reuse as scratch."""
        if a.shape != self.residual.shape or (u_new is None) != (self.velocity is None):
            raise ValueError("commit: the proposal does not belong to this memory")
        old, self.residual = self.residual, a
        if u_new is not None:
            self._next_velocity, self.velocity = self.velocity, u_new
        if sent is None or sent.numel():
            self.update(sent, delivered, mask_velocity)
        return old

    def update(self, sent: Optional[torch.Tensor], delivered: Optional[torch.Tensor] = None,
               mask_velocity: bool = True) -> None:
        """Forget the coordinates ``sent`` (int64 indices, or None for all of them).

        ``delivered`` are the values the receiver will actually see there (after lossy value
        compression such as fp16); what was lost in transit stays in the residual. None means
        delivered exactly. ``mask_velocity=False`` keeps the velocity (``flush`` sends the
        residual, not the momentum).
        """
        r = self.residual
        if sent is None:
            if delivered is None:
                r.zero_()
            else:
                r.sub_(delivered)
            if self.velocity is not None and mask_velocity:
                self.velocity.zero_()
            return
        if delivered is None:
            r.index_fill_(0, sent, 0)
        else:
            r.index_put_((sent,), r.index_select(0, sent) - delivered)
        if self.velocity is not None:
            self.velocity.index_fill_(0, sent, 0)

    def take(self) -> torch.Tensor:
        """Return a copy of the whole residual and zero it (``flush``). The velocity is kept:
        it is future momentum, not unsent gradient."""
        out = self.residual.clone()
        self.residual.zero_()
        return out

    def state_dict(self) -> Dict[str, torch.Tensor]:
        state = {"residual": self.residual.clone()}
        if self.velocity is not None:
            state["velocity"] = self.velocity.clone()
        return state

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        for key, buf in (("residual", self.residual), ("velocity", self.velocity)):
            if buf is None:
                if key in state:
                    raise ValueError(f"checkpoint has a {key} but this memory has no momentum "
                                     "correction: load it with the same momentum_correction")
                continue
            if key not in state:
                raise ValueError(f"checkpoint lacks the memory's {key}")
            src = state[key]
            if src.shape != buf.shape:
                raise ValueError(f"checkpoint {key} has shape {tuple(src.shape)}, expected "
                                 f"{tuple(buf.shape)}: the model or min_compress_numel differs")
            buf.copy_(src)
