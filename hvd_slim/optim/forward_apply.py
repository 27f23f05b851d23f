"""``overlap_forward=True`` on the optimizer's side: a step's updates land stage by stage, as
the next forward pass reaches them (P3's per-layer wait; docs/design.md §2 "Overlap").

``step()`` hands a :class:`~hvd_slim.exchange.overlap.order.Deferred` step to
:meth:`ForwardApply.defer` together with what the wrapped optimizer's step must see then: the
param groups' hyperparameters as they were (a scheduler stepped right after ``step()`` must not
change this step's learning rate). A forward pre-hook on every module (one global hook, which
returns at once when nothing is pending) applies the stage of each parameter the module holds
(itself, or in an ``nn.ParameterList``/``ParameterDict`` of its own) before the module runs:
it commits the stage's exchange, so the pulled values are its parameters' ``.grad``, and steps
the wrapped optimizer on those parameters only. What no
module's forward reached by the next backward, ``step()``, ``synchronize()``, ``flush()``,
``state_dict()`` or :meth:`drain` is applied then.

``.grad`` afterwards is what it would have been without the deferral: the pulled values if the
script left the gradient alone since ``step()``; what ``zero_grad()`` (the optimizer's or the
module's) made of it otherwise, so the next backward starts from that (a parameter with no
gradient at ``step()`` has none after it either). A module the hook has seen also lands the
step before its ``state_dict()``, so a checkpoint of the model is never a step behind.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Set

import torch

from ..api import pending


class ForwardApply:
    """The deferred step of one optimizer. ``stage_params[k]`` are stage ``k``'s parameters;
    ``step_params(ids, groups, count)`` steps the wrapped optimizer on the parameters whose
    ``id`` is in ``ids``, with the hyperparameters ``groups`` (one dict per param group,
    without ``"params"``) of the exchange's step ``count``."""

    def __init__(self, stage_params: List[List[torch.Tensor]],
                 step_params: Callable[[Set[int], List[dict], int], None]) -> None:
        self.stage_params = stage_params
        self.stage_of = {id(p): k for k, ps in enumerate(stage_params) for p in ps}
        self._step_params = step_params
        self.deferred: Optional[Any] = None
        self._groups: List[dict] = []
        self._count = 0
        self._grads: Dict[int, tuple] = {}
        self._late: Set[int] = set()   # applied by the first gradient hook of a backward
        # Modules seen holding our parameters: their state_dict() lands the step first.
        self._saving: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        ref = weakref.ref(self)
        self._handle = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda module, args: _pre_forward(ref, module))
        weakref.finalize(self, self._handle.remove)

    @property
    def pending(self) -> bool:
        return self.deferred is not None and bool(self.deferred.pending)

    def defer(self, deferred: Any, groups: List[dict], count: int) -> None:
        """Hold ``deferred`` (the exchange's step ``count``, 1-based) until its stages are
        reached; ``groups``: the hyperparameters to step them with."""
        self.deferred, self._groups, self._count = deferred, groups, count
        # Each gradient as step() left it, to tell later whether the script zeroed it (weakly:
        # a gradient the script drops is freed, as without the deferral).
        self._grads = {id(p): (None, None) if p.grad is None else
                       (weakref.ref(p.grad), p.grad._version)
                       for ps in self.stage_params for p in ps}
        pending.track(self)   # broadcasts, join and elastic commits drain it first

    def apply(self, k: int) -> None:
        """Commit stage ``k`` and step its parameters (a no-op when it is not pending)."""
        d = self.deferred
        if d is None or k not in d.pending:
            return
        params = self.stage_params[k]
        kept = {}
        for p in params:
            ref, version = self._grads.get(id(p), (None, None))
            if p.grad is None or ref is None or p.grad is not ref() or \
                    p.grad._version != version:
                kept[p] = p.grad   # zeroed or replaced since step(): restored after
                p.grad = None
        try:
            d.settle(k)
            self._step_params({id(p) for p in params}, self._groups, self._count)
        except BaseException:
            self._forget()
            raise
        finally:
            for p, grad in kept.items():
                p.grad = grad
        if not d.pending:
            self._forget()

    def on_grad(self, p: torch.Tensor, name: str) -> None:
        """From the gradient hook: the next backward has begun, so the stages still pending
        (their modules' forward did not run) are applied now, before its exchange starts. If
        the forward pass used one of their parameters all the same, it used it before its
        update landed, which no later step can mend: its gradient then raises (or autograd
        does, for a parameter saved for backward)."""
        if self.pending:
            k = self.stage_of.get(id(p))
            if k is not None and k in self.deferred.pending:
                _stale(name)
            self._late = {id(q) for j in self.deferred.pending for q in self.stage_params[j]}
            self.drain()
        elif self._late and id(p) in self._late:
            _stale(name)

    def settle_all(self) -> None:
        """Apply every stage still pending (a step, synchronize, checkpoint or the script)."""
        self.drain()
        self._late = set()

    def drain(self) -> None:
        """Apply every stage still pending, nearest the input first."""
        while self.pending:
            self.apply(max(self.deferred.pending))

    def discard(self) -> None:
        """Drop the step in flight unapplied, once its exchange has ended (a checkpoint is
        about to replace the state it would change; a failure of it is not raised here)."""
        if self.deferred is not None:
            self.deferred.drop()
        self._forget()
        self._late = set()

    def _forget(self) -> None:
        self.deferred, self._groups, self._grads = None, [], {}
        pending.untrack(self)


# Under torch.compile the hook runs as Python, outside the graph (a graph break where a stage is
# pending): landing a stage waits on another thread and steps an optimizer.
@torch.compiler.disable
def _pre_forward(ref: "weakref.ref[ForwardApply]", module: torch.nn.Module) -> None:
    fa = ref()
    if fa is None or (fa.deferred is None and module in fa._saving):
        return None
    stages = {fa.stage_of[id(p)] for p in _own_parameters(module) if id(p) in fa.stage_of}
    if stages and module not in fa._saving:
        fa._saving.add(module)
        module.register_state_dict_pre_hook(lambda mod, prefix, keep_vars: _before_saving(ref))
    for k in sorted(stages, reverse=True):   # nearest the input first, as drain()
        fa.apply(k)   # a no-op for a stage applied already
    return None


def _before_saving(ref: "weakref.ref[ForwardApply]") -> None:
    """A module of ours is about to give its state_dict(): land the step in flight first."""
    fa = ref()
    if fa is not None and fa.pending:
        fa.drain()


def _own_parameters(module: torch.nn.Module) -> List[torch.Tensor]:
    """The parameters ``module``'s forward reads itself: its own, and those of the parameter
    containers it holds (an ``nn.ParameterList``/``ParameterDict`` has no forward of its own)."""
    out = [p for p in module._parameters.values() if p is not None]
    for child in module._modules.values():
        if isinstance(child, (torch.nn.ParameterList, torch.nn.ParameterDict)):
            out += [p for p in child._parameters.values() if p is not None]
    return out


def _stale(name: str) -> None:
    raise RuntimeError(
        f"hvd_slim: parameter {name!r} got a gradient, but the forward pass used it before its "
        "update from the last step() was applied. With overlap_forward=True an update lands "
        "when a module holding the parameter starts its forward, and this forward pass used "
        "the parameter without running such a module (it is read directly by another module, "
        "or by code outside any module). Call optimizer.apply_updates() before the forward "
        "pass, or pass overlap_forward=False (HVD_SLIM_OVERLAP_FORWARD=0)")
