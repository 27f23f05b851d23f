"""Residual (error-feedback) memory with optional momentum correction, for workers and the server.

A worker's memory holds ``r``, everything it computed but has not sent, and, with momentum
correction, ``u``, its local velocity; the server uses the same class without momentum for its
own residual ``e``. A step is speculative: ``propose`` (or ``propose_parts``) computes ``a``, the
values available to send, and the new velocity without touching the memory; ``commit`` adopts
them and forgets what was sent once every rank agreed on the step. A step that every rank skips
(a NaN/Inf gradient somewhere) is simply never committed, so no residual ever absorbs a
non-finite value and nothing changes. ``update`` forgets sent coordinates of the memory as it is.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch


class ResidualMemory:
    """Error feedback over one flat buffer of ``numel`` coordinates.

    With ``momentum > 0`` (momentum correction, DGC-style):
    ``u = m*u + (1-dampening)*g``; ``a = r + u`` (nesterov: ``a = r + g + m*u``).
    Without: ``a = r + g``. With ``decay`` beta < 1 the residual fades first, ``beta*r`` in place
    of ``r`` (SparseLoCo's decayed error feedback: unsent mass older than about ``1/(1-beta)``
    steps is forgotten, never sent). ``update`` sets ``r = a`` minus what was delivered at the
    sent coordinates and masks ``u`` there (momentum factor masking).
    """

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", momentum: float = 0.0,
                 dampening: float = 0.0, nesterov: bool = False, decay: float = 1.0) -> None:
        if momentum < 0:
            raise ValueError(f"momentum must be >= 0, got {momentum}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = float(decay)
        self.momentum = float(momentum)
        self.dampening = float(dampening)
        self.nesterov = bool(nesterov)
        # ``residual`` is r; a proposal's ``a`` lives in a buffer the caller hands over and becomes
        # the residual at commit (the old buffer goes back to the caller as scratch).
        self.residual = torch.zeros(numel, dtype=dtype, device=device)
        self.velocity: Optional[torch.Tensor] = (
            torch.zeros(numel, dtype=dtype, device=device) if self.momentum > 0 else None)
        # The proposed velocity of the step in flight (momentum only); swapped in by commit.
        self._next_velocity: Optional[torch.Tensor] = (
            torch.zeros(numel, dtype=dtype, device=device) if self.momentum > 0 else None)
        # Gradients in separate tensors are first copied into the proposal's buffer with one
        # _foreach_copy_, so a step launches a fixed number of kernels whatever the number of
        # tensors: on a GPU, where a launch costs more than a pass over memory. On a CPU the
        # extra pass costs more than a call per tensor, and each part is folded where it lies.
        self.stage = torch.device(device).type != "cpu"

    @property
    def numel(self) -> int:
        return self.residual.numel()

    def propose(self, grad: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Return ``(a, u_new)`` for ``grad`` without changing the memory.

        ``a`` is computed in place in ``grad``'s buffer (which the caller hands over); ``u_new``
        (None without momentum) lives in a buffer the memory keeps for this purpose. Pass both
        to :meth:`commit`, or drop them to leave the memory as it was.
        """
        self._check(grad)
        return self.propose_parts([(0, grad.numel(), grad)], grad)

    def propose_parts(self, parts: Sequence[Tuple[int, int, Optional[torch.Tensor]]],
                      out: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """:meth:`propose` for a gradient given in pieces ``(offset, numel, grad or None)``
        (None: zero), with ``a`` written into ``out``: on a CPU the gradients are read where
        they lie (each parameter's ``.grad``), never gathered into a flat copy first; with
        ``stage`` (a GPU) they are, in one launch (:func:`joined`). ``parts`` cover the buffer;
        a part's grad may alias ``out`` at the same place. Parts whose gradients lie end to end
        in memory (views of one flat buffer) are folded as one."""
        parts = joined(parts, out, self.stage)
        r, u, m, beta = self.residual, self.velocity, self.momentum, self.decay
        if u is None:
            for off, n, g in parts:
                if g is None and beta != 1.0:
                    torch.mul(r[off:off + n], beta, out=out[off:off + n])
                elif g is None:
                    out[off:off + n].copy_(r[off:off + n])
                else:
                    self._join(r[off:off + n], g.reshape(-1), out[off:off + n])
            return out, None
        u_new, keep = self._next_velocity, 1.0 - self.dampening
        for off, n, g in parts:
            un, uo = u_new[off:off + n], u[off:off + n]
            if g is None:
                torch.mul(uo, m, out=un)
            elif keep == 1.0:   # u' = g + m*u in one fused pass
                torch.add(g.reshape(-1), uo, alpha=m, out=un)
            else:
                torch.mul(g.reshape(-1), keep, out=un).add_(uo, alpha=m)
            if self.nesterov:   # a = r + g + m*u'
                a = out[off:off + n]
                if g is None and beta != 1.0:
                    torch.mul(r[off:off + n], beta, out=a).add_(un, alpha=m)
                elif g is None:
                    torch.add(r[off:off + n], un, alpha=m, out=a)
                else:
                    self._join(r[off:off + n], g.reshape(-1), a).add_(un, alpha=m)
        if not self.nesterov:   # a = r + u'
            self._join(r, u_new, out)
        return out, u_new

    def _join(self, r: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = decay*r + x`` in one pass; without decay ``r + x``, the bits error feedback
        always had (the same as ``x + r``)."""
        if self.decay == 1.0:
            return torch.add(r, x, out=out)
        return torch.add(x, r, alpha=self.decay, out=out)

    def _check(self, grad: torch.Tensor) -> None:
        if grad.shape != self.residual.shape:
            raise ValueError(f"gradient of shape {tuple(grad.shape)} does not match the memory's "
                             f"{tuple(self.residual.shape)}")

    def commit(self, a: torch.Tensor, u_new: Optional[torch.Tensor],
               sent: Optional[torch.Tensor], delivered: Optional[torch.Tensor] = None,
               mask_velocity: float = 1.0, left: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Adopt a proposal: ``r = a`` and ``u = u_new``, then forget ``sent`` as :meth:`update`
        does (an empty ``sent`` keeps everything: a failed step loses nothing). Returns the old
        residual buffer, which the caller may reuse as scratch."""
        if a.shape != self.residual.shape or (u_new is None) != (self.velocity is None):
            raise ValueError("commit: the proposal does not belong to this memory")
        old, self.residual = self.residual, a
        if u_new is not None:
            self._next_velocity, self.velocity = self.velocity, u_new
        if sent is None or sent.numel():
            self.update(sent, delivered, mask_velocity, left)
        return old

    def takes_left(self, sent: int) -> bool:
        """Whether :meth:`update` writes ``left`` for ``sent`` coordinates (one scatter) rather
        than subtracting what was delivered: up to a sixth of the buffer, so the automatic
        warm-up's start at 8x the default density too. Above it the subtraction gains little
        and ``left`` would hold a large share of a residual's memory until the commit. A
        sender computes ``left`` only then."""
        return 6 * sent <= self.numel

    def update(self, sent: Optional[torch.Tensor], delivered: Optional[torch.Tensor] = None,
               mask_velocity: float = 1.0, left: Optional[torch.Tensor] = None) -> None:
        """Forget the coordinates ``sent`` (int64 indices, or None for all of them).

        ``delivered`` are the values the receiver will actually see there (after lossy value
        compression such as fp16); what was lost in transit stays in the residual. None means
        delivered exactly. ``left``: what stays at ``sent`` (the residual there less
        ``delivered``), when the caller has it: a sender gathered the values it sent, so one
        scatter writes it, bitwise the indexed subtraction (on a CPU, 11.7M coordinates, 7
        December: 0.6 against 1.5 ms at 2%, 2.4 against 4.4 at 5.7%, a warm-up step's, 2.9
        against 4.5 at 16%, but 7.3 against 7.9 at 40%, where the subtraction stays).
        ``mask_velocity`` is the share of the velocity dropped at ``sent`` (True: all; False
        keeps it: ``flush`` and dense warm-up steps send the residual, not the momentum;
        sparse steps pass the ``momentum_masking`` setting).
        """
        r = self.residual
        if sent is not None and left is not None and self.takes_left(sent.numel()):
            r.index_copy_(0, sent, left.to(r.dtype))
        elif sent is None:
            if delivered is None:
                r.zero_()
            else:
                r.sub_(delivered)
        elif delivered is None:
            r[sent] = 0   # index_fill_ is 2-3x slower on a CPU
        else:
            # r - delivered at ``sent`` in one indexed pass (sent is unique: no two adds meet),
            # bitwise what a gather, subtract and scatter gives, in half the time or less.
            r.index_add_(0, sent, delivered.to(r.dtype), alpha=-1)
        self._mask_velocity(sent, float(mask_velocity))

    def _mask_velocity(self, sent: Optional[torch.Tensor], share: float) -> None:
        """Drop ``share`` of the velocity at ``sent`` (None: everywhere); 1.0 zeroes it there."""
        u = self.velocity
        if u is None or share == 0.0:
            return
        if sent is None:
            if share == 1.0:
                u.zero_()
            else:
                u.mul_(1.0 - share)
        elif share == 1.0:
            u[sent] = 0
        else:
            u.index_put_((sent,), u.index_select(0, sent) * (1.0 - share))

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


def joined(parts: Sequence[Tuple[int, int, Optional[torch.Tensor]]], out: torch.Tensor,
           stage: bool) -> List[Tuple[int, int, Optional[torch.Tensor]]]:
    """``parts`` (``(offset, numel, grad or None)``, in order, end to end in ``out``) with each
    run of gradients that lie end to end in memory made one part, a view across them (no copy).
    ``stage``: when every part has a gradient, they are all copied into ``out`` with one
    ``_foreach_copy_`` and become one part aliasing it. Either way the arithmetic that
    follows reads the same values, element by element, so its bits do not change; a missing
    gradient keeps the parts apart (its zeros are not written: -0.0 + 0.0 is +0.0)."""
    if stage and len(parts) > 1 and all(g is not None for _, _, g in parts):
        torch._foreach_copy_([out[off:off + n] for off, n, _ in parts],
                             [g.reshape(-1) for _, _, g in parts])
        return [(0, out.numel(), out)]
    merged: List[Tuple[int, int, Optional[torch.Tensor]]] = []
    for off, n, g in parts:
        if merged and g is not None and _follows(merged[-1], g, off):
            off0, n0, g0 = merged[-1]
            merged[-1] = (off0, n0 + n, g0.reshape(-1).as_strided(
                (n0 + n,), (1,), g0.storage_offset()))
        else:
            merged.append((off, n, g))
    return merged


def _follows(prev: Tuple[int, int, Optional[torch.Tensor]], g: torch.Tensor, off: int) -> bool:
    """Whether ``g`` (at ``off`` in the buffer) continues ``prev``'s gradient in memory."""
    off0, n0, g0 = prev
    return (g0 is not None and off == off0 + n0 and g.is_contiguous() and g0.is_contiguous()
            and g.dtype == g0.dtype and g.device == g0.device
            and g.untyped_storage().data_ptr() == g0.untyped_storage().data_ptr()
            and g.data_ptr() == g0.data_ptr() + n0 * g0.element_size())
