"""Adam's update through the DDP hook: ``SlimState(optimizer=opt)`` with torch's Adam or AdamW.

A hook sees gradients, and under Adam compressed gradients fed into one Adam fall far behind
(docs/accuracy.md; 18.8% on the 600-step transformer through the hook). As
``DistributedOptimizer`` does (optim/inner/adam_update.py, whose arithmetic this shares), each
rank turns each bucket's gradient into its own Adam update with its own moments before the
exchange, and the exchange carries updates. The optimizer's ``step()`` is then taken over: it
steps every parameter the hook delivered by the delivered update (AdamW's decoupled decay first),
not by Adam again. Its ``param_groups`` stay the user's, so LR schedulers work as before.

The small tensors the exchange sends dense (under ``min_compress_numel``: norms, biases) travel
as gradients, and the wrapped optimizer's own step takes their exact average from ``p.grad``,
as ``DistributedOptimizer``'s update exchange does.

What ``step()`` applies to the others is the update as the hook delivered it: a
``GradScaler``'s ``unscale_`` or a clip of ``p.grad`` after backward does not change it (the
exchange carries each rank's update, already normalised). The moments follow the pass: kept
when it commits, dropped when every rank skipped it.
"""
from __future__ import annotations

import types
from typing import AbstractSet, Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..optim.inner.adam_update import WarnOnce, _decoupled, altered, rank_updates, step_by
from .checks import refuse_old_format


# 2: the small tensors sent dense take the wrapped optimizer's own step (1: each rank's update,
# for every tensor).
FORMAT = 2


def check_optimizer(optimizer: Any) -> None:
    """Refuse what the update exchange cannot serve, naming the setting."""
    served = (torch.optim.Adam, torch.optim.AdamW)
    if type(optimizer) not in served:
        inner = getattr(optimizer, "optimizer", None)
        if type(inner) in served:
            raise ValueError(f"SlimState(optimizer=...) takes torch's {type(inner).__name__} "
                             f"itself, got the {type(optimizer).__name__} wrapping it: pass "
                             f"its .optimizer")
        raise ValueError(f"SlimState(optimizer=...) takes torch.optim.Adam or AdamW, got "
                         f"{type(optimizer).__name__}: other optimizers step on the exchanged "
                         f"gradients as DDP's allreduce would leave them; leave optimizer unset")
    for g in optimizer.param_groups:
        for flag in ("amsgrad", "differentiable", "foreach_step_is_per_param"):
            if g.get(flag, False):
                raise ValueError(f"SlimState(optimizer=...): {flag}=True is not served by the "
                                 f"update exchange; leave optimizer unset")
    if getattr(optimizer, "_hvd_slim_hook_adam", None) is not None:
        raise ValueError("SlimState(optimizer=...): this optimizer already serves another "
                         "SlimState; make one optimizer per state")


class HookAdam:
    """Each rank's Adam moments for the parameters the hook exchanges (by their key), and the
    wrapped optimizer's ``step()`` taken over."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        check_optimizer(optimizer)
        self.opt = optimizer
        # By position: load_state_dict() replaces the group dicts (and a scheduler then steps
        # the new ones' lr).
        self._group = {id(p): i for i, g in enumerate(optimizer.param_groups)
                       for p in g["params"]}
        # key -> [m, v, w, steps]; next moments of the pass in flight: key -> (mn, vn, wn)
        self.moments: Dict[int, list] = {}
        self._next: Dict[int, tuple] = {}
        # key -> three buffers the next pass writes its moments into: the moments a settled
        # pass replaced (or the ones it dropped), so no pass allocates model-sized tensors.
        self._spare: Dict[int, tuple] = {}
        self._delivered: Dict[int, torch.Tensor] = {}   # id(param) -> its update, this pass
        self.scale = 1.0   # this pass's loss scale (new_pass), taken out of its gradients
        optimizer.step = types.MethodType(_step, optimizer)  # type: ignore[method-assign]
        optimizer._hvd_slim_hook_adam = self  # type: ignore[attr-defined]

    # --- in the hook ------------------------------------------------------------------------
    @torch.no_grad()
    def precondition(self, keys: Sequence[int], params: Sequence[torch.Tensor],
                     buffer: torch.Tensor, size: int, dense: AbstractSet[int] = frozenset()
                     ) -> None:
        """Turn the bucket's gradients (``buffer``, ``params`` in bucket order) into this
        rank's Adam updates, in place; the next moments wait for :meth:`settle`. The
        parameters in ``dense`` (keys the exchange sends dense) keep their gradient: its exact
        average comes back, and the optimizer's own step takes it. The pass's loss scale
        (:meth:`new_pass`) is taken out first, so the moments are of the true gradient; the
        dense ones keep it, for the scaler's ``unscale_``. A parameter without a gradient
        (unused by this rank's backward) is passed by, as torch's Adam passes it by."""
        # One float32 copy of the whole bucket (the dense parts unused), and the arithmetic for
        # every parameter alike in param group and Adam step at once (rank_updates): the
        # launches of a pass do not grow with the number of tensors.
        g_all = buffer.to(torch.float32, copy=True)
        if self.scale != 1.0:   # a power of two: exact
            g_all.div_(self.scale)
        # (param group, Adam step) -> (gradient, its place in the bucket, p, moments, next)
        runs: Dict[Tuple[int, int], List[Tuple[Any, ...]]] = {}
        offset = 0
        for k, p in zip(keys, params):
            n = p.numel()
            # A parameter this rank's backward did not reach (DDP's find_unused_parameters) has
            # no gradient: as torch's Adam does, its moments neither decay nor count a step,
            # and its part of the bucket (zeros) sends no update. (With
            # gradient_as_bucket_view=True every .grad is a view of the bucket: never None.)
            if k in dense or p.grad is None:
                offset += n
                continue
            gi = self._group.get(id(p))
            if gi is None:
                raise ValueError(f"SlimState(optimizer=...): a parameter of shape "
                                 f"{tuple(p.shape)} in DDP's buckets is not in the optimizer; "
                                 f"give SlimState the optimizer of the whole DDP model")
            mom = self.moments.get(k)
            if mom is None:
                mom = self.moments[k] = [torch.zeros(n, dtype=torch.float32, device=p.device)
                                         for _ in range(3)] + [0]
            nxt = self._spare.pop(k, None) or tuple(torch.empty_like(mom[0]) for _ in range(3))
            runs.setdefault((gi, mom[3]), []).append(
                (g_all[offset:offset + n], buffer[offset:offset + n], p, mom, nxt))
            self._next[k] = nxt
            offset += n
        for (gi, step), run in runs.items():
            gs, places, ps, moms, nxts = (list(x) for x in zip(*run))
            group = self.opt.param_groups[gi]
            rank_updates(gs, ps, group, _decoupled(self.opt, group),
                         tuple([m[i] for m in moms] for i in range(3)),
                         tuple([x[i] for x in nxts] for i in range(3)), step + 1, size)
            torch._foreach_copy_(places, gs)

    def settle(self, keep: bool) -> None:
        """The pass ended: ``keep`` the new moments (committed, or failed with the updates in
        the residuals), or drop them (every rank skipped it)."""
        for k, nxt in self._next.items():
            mom = self.moments[k]
            if keep:
                self._spare[k] = tuple(mom[:3])
                mom[0], mom[1], mom[2], mom[3] = nxt[0], nxt[1], nxt[2], mom[3] + 1
            else:
                self._spare[k] = nxt
        self._next = {}

    def deliver(self, params: Sequence[torch.Tensor], result: torch.Tensor, keys: Sequence[int],
                dense: AbstractSet[int]) -> None:
        """What the pass delivered for ``params`` (bucket order, with their ``keys``), for
        :func:`_step`: the updates; the average gradient of a parameter in ``dense`` reaches
        it as DDP's own, in ``p.grad``."""
        kept = result.detach().clone()   # one copy; each parameter's update a view of it
        offset = 0
        for p, k in zip(params, keys):
            n = p.numel()
            if k not in dense:
                self._delivered[id(p)] = kept[offset:offset + n].view(p.shape)
            offset += n

    def new_pass(self, scale: float = 1.0) -> None:
        """A backward pass begins, its gradients carrying a GradScaler's loss ``scale`` (1:
        none): a delivery its step never took (GradScaler skipped it) is dropped."""
        self._delivered, self.scale = {}, scale

    # --- the optimizer's step ---------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Step each parameter whose update was delivered by it; then the wrapped optimizer's
        own step takes the rest (the small tensors sent dense: DDP left their exact average
        gradient in ``p.grad``), as ``DistributedOptimizer``'s update exchange does."""
        stepped = []
        for group in self.opt.param_groups:
            ps, deltas = [], []
            for p in group["params"]:
                delta = self._delivered.pop(id(p), None)
                if delta is not None:
                    # One parameter is read (a clip or an unscale_ changes them all): a check
                    # per step, not per tensor.
                    if not stepped and not CHANGED_AFTER_BACKWARD.given and \
                            p.grad is not None and altered(p.grad, delta, self.scale):
                        CHANGED_AFTER_BACKWARD()
                    ps.append(p)
                    deltas.append(delta)
                    stepped.append((p, p.grad))
                    p.grad = None   # stepped already: the wrapped step must pass it by
            step_by(ps, deltas, group, _decoupled(self.opt, group))
        try:
            type(self.opt).step(self.opt)
        finally:
            for p, g in stepped:
                p.grad = g

    # --- checkpoint -------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"format": FORMAT, "moments": {k: {"exp_avg": m[0].clone(),
                                                   "exp_avg_sq": m[1].clone(),
                                                   "mean_sq": m[2].clone(), "step": m[3]}
                                               for k, m in self.moments.items()}}

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        refuse_old_format(state, "format", 1, "checkpoint's Adam state",
                          "hook stepped every tensor by each rank's update",
                          "steps the small tensors sent dense with the optimizer's own Adam "
                          "(format 2)")
        if not isinstance(state, dict) or state.get("format") != FORMAT or \
                not isinstance(state.get("moments"), dict):
            raise ValueError("hvd_slim.ddp: the checkpoint holds no Adam moments of the update "
                             "exchange (was it saved by a SlimState without optimizer=?)")
        moments: Dict[int, List[Any]] = {}
        for k, m in state["moments"].items():
            if not isinstance(m, dict) or not all(isinstance(m.get(x), torch.Tensor) for x in
                                                  ("exp_avg", "exp_avg_sq", "mean_sq")):
                raise ValueError(f"hvd_slim.ddp: the Adam moments of parameter {k} are "
                                 f"malformed in the checkpoint")
            moments[int(k)] = [m["exp_avg"].clone(), m["exp_avg_sq"].clone(),
                               m["mean_sq"].clone(), int(m["step"])]
        self.moments, self._next, self._delivered, self._spare = moments, {}, {}, {}


CHANGED_AFTER_BACKWARD = WarnOnce(
    "hvd_slim.ddp: p.grad changed between backward and step() (a gradient clip, or a "
    "GradScaler's unscale_). With SlimState(optimizer=...) the hook exchanged each rank's Adam "
    "update in backward, already normalised, and step() applies it as delivered: a clip after "
    "backward does not reach it. With a GradScaler, call state.set_grad_scaler(scaler): its "
    "unscale_ is then expected, and its scale kept out of Adam's moments.")


def _step(self: torch.optim.Optimizer, closure: Any = None) -> Any:
    """The wrapped optimizer's ``step()`` under the hook's update exchange: each parameter
    steps by the update the hook delivered for it (see the module docstring)."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    self._hvd_slim_hook_adam.step()  # type: ignore[attr-defined]
    # An LR scheduler made before the SlimState wrapped the step this replaces; it checks this
    # flag to tell that the optimizer stepped.
    self._opt_called = True  # type: ignore[attr-defined]
    return loss
