"""Rounds of local steps (``local_steps=H``), as DiLoCo trains over slow links.

Every rank keeps the **global parameters** (the same on every rank, bitwise) beside the model's,
which are its **local** ones. A round is H steps of the wrapped optimizer on this rank's own
gradients, with no communication. At its end the **pseudo-gradient** ``global - local`` of
every trainable parameter goes through the Slim-DP exchange like a gradient (residual and error
feedback, core and exploration, push, server, pull), and the **outer optimizer** steps the
global parameters on the pulled average. Every rank then continues from the new global
parameters. The default outer optimizer for dense rounds (``density=1.0``) is DiLoCo's: SGD
with Nesterov momentum, lr 0.7, momentum 0.9. Over a sparse exchange (``density < 1``) it is
plain SGD at lr 1, SparseLoCo's: the worker's residual
(error feedback, config/settings.py's ``LOCAL_DEFAULTS``) already carries what an outer momentum
would, and DiLoCo's Nesterov on top of it counts momentum twice.

The outer optimizer is built over the model's own parameters: for its step they are set to the
global ones, their ``.grad`` holds the pulled pseudo-gradient, and what it leaves in them is the
new global state. So its state is keyed by the same parameters, and every rank's outer state is
bitwise the same (same pulled values, same order).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

DEFAULT_OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}   # DiLoCo's, for dense rounds
SPARSE_OUTER = {"lr": 1.0, "momentum": 0.0}                         # SparseLoCo's


def outer_defaults(density: float) -> Dict[str, Any]:
    """The default outer SGD's settings: DiLoCo's for dense rounds (``density`` 1.0), else
    SparseLoCo's."""
    return DEFAULT_OUTER if density >= 1.0 else SPARSE_OUTER


def default_outer_optimizer(params: Sequence[torch.Tensor],
                            density: float = 1.0) -> torch.optim.Optimizer:
    """The default outer optimizer for rounds at ``density``: SGD as :func:`outer_defaults`."""
    return torch.optim.SGD(list(params), **outer_defaults(density))


def check_outer_optimizer(outer: Any, params: Sequence[torch.Tensor], local_steps: int,
                          note: str = "") -> Optional[torch.optim.Optimizer]:
    """``outer_optimizer`` validated against the wrapped optimizer's trainable parameters."""
    if outer is None:
        return None
    if local_steps <= 1:
        raise ValueError(f"outer_optimizer needs local_steps > 1 (local_steps={local_steps}"
                         f"{note}): with one local step the wrapped optimizer steps on the "
                         "exchanged gradients itself")
    if not isinstance(outer, torch.optim.Optimizer):
        raise ValueError(f"outer_optimizer must be a torch.optim.Optimizer over the model's "
                         f"parameters, e.g. torch.optim.SGD(model.parameters(), lr=0.7, "
                         f"momentum=0.9, nesterov=True); got {type(outer).__name__}")
    if getattr(outer, "_hvd_slim_wrapped", False):
        raise ValueError("outer_optimizer must be a plain torch.optim.Optimizer, not an hvd_slim "
                         "DistributedOptimizer")
    mine = {id(p) for p in params}
    theirs = [p for g in outer.param_groups for p in g["params"]]
    if {id(p) for p in theirs} != mine or len(theirs) != len(mine):
        raise ValueError(f"outer_optimizer must hold exactly the trainable parameters of the "
                         f"wrapped optimizer ({len(mine)}); it holds {len(theirs)} others or "
                         "more. Build it over the same model.parameters()")
    return outer


def describe_outer_optimizer(outer: Optional[torch.optim.Optimizer],
                             density: float = 1.0) -> str:
    """The outer optimizer's class and settings (None: the default at ``density``), as the
    first-step handshake compares them."""
    if outer is None:
        return "SGD(" + ", ".join(f"{k}={v!r}" for k, v in outer_defaults(density).items()) \
            + ") (default)"
    # How torch runs the step (not what it computes) may differ between ranks' builds.
    how = ("params", "foreach", "differentiable", "capturable")
    groups = ["(" + ", ".join(f"{k}={v!r}" for k, v in sorted(g.items()) if k not in how)
              + ")" for g in outer.param_groups]
    return type(outer).__name__ + "".join(groups)


def matches_params(saved: Any, params: Sequence[torch.Tensor]) -> bool:
    """Whether ``saved`` (from a checkpoint) is a list of tensors shaped and typed as
    ``params``, one each."""
    return isinstance(saved, list) and len(saved) == len(params) and all(
        torch.is_tensor(t) and t.shape == p.shape and t.dtype == p.dtype
        for t, p in zip(saved, params))


class OuterRounds:
    """This rank's round: the global parameters, the outer optimizer and the local steps
    taken since the round began."""

    def __init__(self, params: List[torch.Tensor], local_steps: int,
                 outer: Optional[torch.optim.Optimizer], density: float = 1.0) -> None:
        self.params = list(params)
        self.local_steps = local_steps
        self.outer = outer if outer is not None else \
            default_outer_optimizer(self.params, density)
        self.global_params = [p.detach().clone() for p in self.params]
        # Taken again at the first step (capture): a script broadcasts rank 0's parameters
        # after building the optimizer, as Horovod's examples do.
        self.captured = False
        self.taken = 0          # local steps of the current round
        self.local_total = 0    # every local step, for comm_stats()

    def capture(self) -> bool:
        """At the first local step (unless a checkpoint was loaded): the global parameters are
        the model's as training starts. Returns whether it captured them now."""
        if self.captured:
            return False
        with torch.no_grad():
            for p, g in zip(self.params, self.global_params):
                g.copy_(p)
        self.captured = True
        return True

    def tick(self) -> bool:
        """One local step was taken; True when it ends the round."""
        self.taken += 1
        self.local_total += 1
        return self.taken >= self.local_steps

    def pseudo_gradients(self) -> List[torch.Tensor]:
        """``global - local`` for every trainable parameter (what the exchange sends)."""
        return [g - p.detach() for p, g in zip(self.params, self.global_params)]

    def load_pseudo_gradients(self, deltas: Optional[List[torch.Tensor]] = None) -> None:
        """``p.grad = global - local`` (or ``deltas``, computed before) for every trainable
        parameter."""
        for p, delta in zip(self.params, deltas or self.pseudo_gradients()):
            if p.grad is None or p.grad.shape != p.shape:
                p.grad = delta
            else:
                p.grad.copy_(delta)

    def apply(self, only: Optional[set] = None,
              grads: Optional[List[torch.Tensor]] = None) -> None:
        """The outer step on the pulled pseudo-gradient (in ``p.grad``, or ``grads``) from the
        global parameters; afterwards they, and the model, hold the new global parameters.
        ``only``: the ids of the parameters to step (a flush steps the compressed ones)."""
        if grads is not None:
            for p, grad in zip(self.params, grads):
                p.grad = grad
        with torch.no_grad():
            saved = []
            for p, g in zip(self.params, self.global_params):
                p.copy_(g)
                if only is not None and id(p) not in only:
                    saved.append((p, p.grad))
                    p.grad = None   # the outer optimizer leaves a parameter without a grad be
            self.outer.step()
            for p, grad in saved:
                p.grad = grad
            for p, g in zip(self.params, self.global_params):
                g.copy_(p)
        self.taken = 0

    def apply_flushed(self, only: set) -> None:
        """A flush's pulled residuals (in ``p.grad`` of the parameters in ``only``, the
        compressed ones) land on the global parameters as they are: lr 1, past the outer
        optimizer, whose state is left alone (an outer step would also repeat its momentum).
        Under local steps the residuals hold rounds of unsent displacement, and landing them
        at once still costs the language model (docs/accuracy.md, "Local steps")."""
        with torch.no_grad():
            for p, g in zip(self.params, self.global_params):
                if id(p) in only and p.grad is not None:
                    g.sub_(p.grad.to(g.dtype))
                p.copy_(g)
        self.taken = 0

    def reset(self) -> None:
        """A round every rank dropped (a NaN/Inf under ``nonfinite="flag"``/``"skip"``, or an
        error): the model goes back to the global parameters, which have not changed."""
        with torch.no_grad():
            for p, g in zip(self.params, self.global_params):
                p.copy_(g)
        self.taken = 0

    # --- checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"local_steps": self.local_steps, "taken": self.taken,
                "local_total": self.local_total, "captured": self.captured,
                "global": [g.clone() for g in self.global_params],
                "outer": self.outer.state_dict()}

    def validate_state_dict(self, state: Any) -> None:
        """Raise ValueError, naming what differs, unless ``state`` loads here."""
        if not isinstance(state, dict) or "global" not in state:
            raise ValueError("hvd_slim checkpoint has no local-steps state ('hvd_slim_outer'): "
                             f"it was saved without local_steps > 1; this optimizer has "
                             f"local_steps={self.local_steps}. Resume with the local_steps it "
                             "was saved with")
        if state.get("local_steps") != self.local_steps:
            raise ValueError(f"hvd_slim checkpoint was saved with local_steps="
                             f"{state.get('local_steps')}; this optimizer has local_steps="
                             f"{self.local_steps}. Resume with the same local_steps")
        saved = state["global"]
        if not matches_params(saved, self.params):
            raise ValueError("hvd_slim checkpoint: its global parameters do not match this "
                             "model's trainable parameters (count, shapes or dtypes)")
        taken = state.get("taken")
        if isinstance(taken, bool) or not isinstance(taken, int) or \
                not 0 <= taken < self.local_steps:
            raise ValueError(f"hvd_slim checkpoint: 'taken' must be an integer in "
                             f"[0, {self.local_steps}), got {taken!r}")

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.validate_state_dict(state)
        self.outer.load_state_dict(state["outer"])
        for g, t in zip(self.global_params, state["global"]):
            g.copy_(t)
        self.taken = int(state["taken"])
        self.local_total = int(state.get("local_total", 0))
        self.captured = bool(state.get("captured", True))
