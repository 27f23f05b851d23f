"""Adam and AdamW that exchange their update, not the gradient (``adam_exchange="update"``).

Why: error feedback delivers a coordinate in bursts, and Adam's second moment is not linear in
the gradient, so no rule for feeding bursts into one shared Adam (optim/inner/adam.py) behaves like
dense Adam; on a byte-level transformer the gradient path ends 20-60% behind dense in bits per
byte (docs/accuracy.md). Every method that keeps Adam's accuracy under compression compresses
something linear in the final update instead (1-bit Adam, DeMo, SparseLoCo). Here each rank
keeps its own Adam moments on its own gradient, turns the gradient into its update
``lr * m_hat / (sqrt(v_hat) + eps)`` before the exchange, and the exchange (error feedback and
all) carries updates; every replica then applies the same delivered average as a parameter
delta, with AdamW's decoupled weight decay, so the replicas stay bitwise identical. Adam's L2
weight decay joins the gradient first, as in ``torch.optim.Adam``.

One rank's gradient is noisier than the average of N ranks', so its own second moment
``E[g_i^2] = mu^2 + sigma^2`` overstates the average's ``mu^2 + sigma^2 / N``, and Adam's
steps shrink where the noise dominates (4% worse bits per byte on the fair-horizon probe,
exchange exact). Each rank therefore normalises by a local estimate of the average's second
moment: ``v / N + (1 - 1/N) * w``, where ``w`` is a slow average (beta2) of ``m_hat^2``, whose
own noise is about ``(1 - beta1) / (1 + beta1)`` of the gradient's. At N = 1 it is Adam.

The moments are flat float32 buffers per compressed bucket (whatever the parameters' dtype),
computed speculatively: a step every rank skips (a NaN/Inf somewhere) leaves them as they were.
They are per rank and travel in the checkpoint under ``"hvd_slim_adam"``. Dense buckets (the
small tensors) keep the wrapped optimizer's own step on the exact average gradient.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

if TYPE_CHECKING:   # pragma: no cover
    from ...config import SlimConfig
    from ...exchange.layout import Layout

log = logging.getLogger("hvd_slim")
FORMAT = 1   # the checkpoint entry's version


def resolve_mode(optimizer: torch.optim.Optimizer, config: "SlimConfig",
                 user_class: type) -> Tuple[str, Optional[str]]:
    """What ``adam_exchange`` means for this optimizer: ``("update" | "gradient", why)``, where
    ``why`` says why "auto" kept the gradient for an Adam-family optimizer (None when it did
    not, or for any other optimizer). An explicit "update" that cannot be served raises
    ValueError naming the keyword and what to pass instead."""
    mode = config.adam_exchange
    if mode == "gradient":
        return "gradient", None
    if not isinstance(optimizer, torch.optim.Adam):
        if mode == "update":
            raise ValueError(f"adam_exchange='update' needs torch.optim.Adam or AdamW, got "
                             f"{user_class.__name__}{config.env_note('adam_exchange')}. Leave "
                             "it 'auto'")
        return "gradient", None
    blockers = [why for bad, why in (
        (any(g.get("amsgrad", False) for g in optimizer.param_groups),
         "amsgrad=True is not served by the update exchange"),
        (any(g.get("differentiable", False) for g in optimizer.param_groups),
         "differentiable=True is not served by the update exchange"),
        (config.local_steps > 1, "local_steps > 1 exchanges the update of local steps already"),
        (config.overlap > 1, "overlap > 1 starts each stage's exchange in backward, before "
         "Adam's step"),
        (config.op != "average", "op=Sum would sum the ranks' updates"),
        (config.adam_variance == "rescaled", "adam_variance='rescaled' belongs to the gradient "
         "exchange")) if bad]
    if mode == "update":
        if blockers:
            raise ValueError(f"adam_exchange='update' cannot be served: {blockers[0]}"
                             f"{config.env_note('adam_exchange')}. Pass adam_exchange="
                             "'gradient', or leave it 'auto'")
        return "update", None
    if user_class not in (torch.optim.Adam, torch.optim.AdamW):
        return "gradient", (f"{user_class.__name__} subclasses torch's Adam and its step may "
                            "differ; pass adam_exchange='update' to use torch's Adam step")
    return ("gradient", blockers[0]) if blockers else ("update", None)


class AdamUpdate:
    """Each rank's Adam moments for the compressed buckets, and the two ends of a step:
    :meth:`precondition` turns every compressed ``p.grad`` into this rank's update before the
    exchange; :meth:`apply` steps the parameters by what the exchange delivered. In between,
    :meth:`settle` keeps the new moments (the step went through, or failed with the update in
    the residual) or drops them (every rank skipped the step)."""

    def __init__(self, optimizer: torch.optim.Optimizer, layout: "Layout", size: int) -> None:
        self.opt, self.size = optimizer, size
        self.buckets = list(layout.sparse)
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        # Per bucket: its segments with their param group, and the flat moments (float32).
        self.segments = [[(s, group_of[id(s.param)]) for s in b.segments] for b in self.buckets]
        zeros = lambda b: torch.zeros(b.numel, dtype=torch.float32, device=b.device)  # noqa
        # m, v: Adam's moments of this rank's gradient; w: the slow average of m_hat^2.
        self.m, self.v, self.w = ([zeros(b) for b in self.buckets] for _ in range(3))
        self._m_next, self._v_next, self._w_next = ([zeros(b) for b in self.buckets]
                                                    for _ in range(3))
        self._scratch = [zeros(b) for b in self.buckets]
        # Adam's step count per parameter (a parameter with no gradient on this rank is not
        # stepped, as torch's Adam skips it).
        self.steps: List[List[int]] = [[0] * len(seg) for seg in self.segments]
        self._stepped: Optional[List[List[bool]]] = None   # the step in flight
        self._scale = 1.0   # the loss scale the last precondition() took out (set_grad_scaler)
        self._snapshot: Optional[List[torch.Tensor]] = None

    # --- before the exchange -------------------------------------------------------------------
    @torch.no_grad()
    def precondition(self, scale: float = 1.0) -> None:
        """Turn every compressed ``p.grad`` into this rank's Adam update (in place, in the
        gradient's dtype), computing the next moments aside; a parameter without a gradient
        is left alone. ``scale``: a GradScaler's loss scale still in the gradients (Horovod's
        AMP order exchanges before ``unscale_``), taken out first, so the moments are of the
        true gradient whatever the scale does.

        The arithmetic runs once per run of neighbouring parameters that share a param group
        and an Adam step (usually the whole bucket), on the flat buffers, and the gradients
        move in and out in one ``_foreach_copy_`` each: the kernels a step launches do not
        grow with the number of tensors. Elementwise, the bits are those of one parameter at a
        time."""
        groups = self.opt.param_groups
        stepped = []
        self._scale = scale
        for bi, segs in enumerate(self.segments):
            m, v, w, g32 = self.m[bi], self.v[bi], self.w[bi], self._scratch[bi]
            mn, vn, wn = self._m_next[bi], self._v_next[bi], self._w_next[bi]
            grads = [s.param.grad for s, _ in segs]
            for (s, _), grad in zip(segs, grads):
                if grad is not None and grad.is_sparse:
                    raise ValueError(f"hvd_slim: parameter {s.name!r} has a sparse gradient, "
                                     "which adam_exchange='update' does not serve; pass "
                                     "adam_exchange='gradient'")
            flags = [g is not None for g in grads]
            views = [g32[s.offset:s.offset + s.numel].view(s.param.shape)
                     for (s, _), hit in zip(segs, flags) if hit]
            got = [g for g in grads if g is not None]
            if got:
                torch._foreach_copy_(views, got)
            for lo, hi, first, last in _runs(segs, flags, self.steps[bi]):
                sl = slice(lo, hi)
                if not flags[first]:   # no gradient: the moments stay as they were
                    mn[sl].copy_(m[sl])
                    vn[sl].copy_(v[sl])
                    wn[sl].copy_(w[sl])
                    continue
                if scale != 1.0:
                    g32[sl].div_(scale)
                gi = segs[first][1]
                rank_update(g32[sl], [s.param for s, _ in segs[first:last]], groups[gi],
                            _decoupled(self.opt, groups[gi]), (m[sl], v[sl], w[sl]),
                            (mn[sl], vn[sl], wn[sl]), self.steps[bi][first] + 1, self.size)
            if got:
                torch._foreach_copy_(got, views)
            stepped.append(flags)
        self._stepped = stepped
        self._snapshot = None

    def settle(self, keep: bool) -> None:
        """After the exchange: ``keep`` the new moments (the step went through, or failed and
        kept this rank's update in its residual), or drop them (every rank skipped it)."""
        if self._stepped is None:
            return
        if keep:
            self.m, self._m_next = self._m_next, self.m
            self.v, self._v_next = self._v_next, self.v
            self.w, self._w_next = self._w_next, self.w
            for bi, flags in enumerate(self._stepped):
                for j, hit in enumerate(flags):
                    if hit:
                        self.steps[bi][j] += 1
        self._stepped = None

    # --- after the exchange --------------------------------------------------------------------
    def snapshot(self) -> None:
        """Keep what the exchange delivered (after an explicit ``synchronize()``), so a
        GradScaler's ``unscale_`` or a clip of ``p.grad`` before ``step()`` does not change the
        update; :meth:`apply` steps by the snapshot, and logs once when ``p.grad`` changed."""
        self._snapshot = []
        for bi, segs in enumerate(self.segments):
            flat = self._scratch[bi]
            for s, _ in segs:
                g = s.param.grad
                part = flat[s.offset:s.offset + s.numel]
                part.zero_() if g is None else part.copy_(g.reshape(-1))
            self._snapshot.append(flat)

    @torch.no_grad()
    def apply(self, only: Optional[set] = None, decay: bool = True) -> None:
        """Step the compressed parameters by the delivered update in ``p.grad`` (or the
        snapshot): ``p -= update``, after AdamW's decoupled decay ``p *= 1 - lr * wd``
        (``decay``; a flush delivers residuals only). ``only``: the parameter ids to step.
        One ``_foreach`` call per param group and operation."""
        groups = self.opt.param_groups
        snap, self._snapshot = self._snapshot, None
        changed = checked = False
        by_group: Dict[int, Tuple[List[torch.Tensor], List[Optional[torch.Tensor]]]] = {}
        for bi, segs in enumerate(self.segments):
            for s, gi in segs:
                p = s.param
                if only is not None and id(p) not in only:
                    continue
                delta = p.grad
                if snap is not None:
                    delta = snap[bi][s.offset:s.offset + s.numel].view(p.shape)
                    # One parameter is read (a clip or an unscale_ changes them all): a check
                    # per step, not per tensor.
                    if p.grad is not None and not checked and not CHANGED_AFTER_SYNC.given:
                        changed, checked = altered(p.grad, delta, self._scale), True
                ps, ds = by_group.setdefault(gi, ([], []))
                ps.append(p)
                ds.append(delta)
        for gi, (ps, ds) in by_group.items():
            step_by(ps, ds, groups[gi], _decoupled(self.opt, groups[gi]), decay)
        if changed:
            CHANGED_AFTER_SYNC()

    # --- checkpoint ----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"format": FORMAT, "numel": [b.numel for b in self.buckets],
                "exp_avg": [m.clone() for m in self.m],
                "exp_avg_sq": [v.clone() for v in self.v],
                "mean_sq": [w.clone() for w in self.w],
                "steps": [list(s) for s in self.steps]}

    def validate(self, state: Any) -> None:
        """Raise ValueError unless ``state`` (from :meth:`state_dict`) loads here."""
        fix = ("Resume with the same model and adam_exchange, or drop the 'hvd_slim_adam' "
               "entry to start the moments afresh")
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError(f"hvd_slim checkpoint: the Adam update state has an unknown "
                             f"format {state.get('format') if isinstance(state, dict) else state!r}"
                             f" (expected {FORMAT}). {fix}")
        numel = [b.numel for b in self.buckets]
        if state.get("numel") != numel:
            raise ValueError(f"hvd_slim checkpoint: the Adam update state covers buckets of "
                             f"{state.get('numel')} coordinates, this model {numel}. {fix}")
        for key in ("exp_avg", "exp_avg_sq", "mean_sq"):
            got = state.get(key)
            if not isinstance(got, list) or len(got) != len(numel) or any(
                    not isinstance(x, torch.Tensor) or x.shape != (n,)
                    for x, n in zip(got, numel)):
                raise ValueError(f"hvd_slim checkpoint: the Adam update state's {key} does not "
                                 f"match this model's buckets. {fix}")
        steps = state.get("steps")
        if not isinstance(steps, list) or [len(s) for s in steps] != \
                [len(s) for s in self.segments]:
            raise ValueError(f"hvd_slim checkpoint: the Adam update state's step counts do not "
                             f"match this model's parameters. {fix}")

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.validate(state)
        for dst, src in zip(self.m + self.v + self.w,
                            state["exp_avg"] + state["exp_avg_sq"] + state["mean_sq"]):
            dst.copy_(src)
        self.steps = [[int(x) for x in s] for s in state["steps"]]
        self._stepped = None
        self._snapshot = None


@torch.no_grad()
def rank_update(g: torch.Tensor, params: Sequence[torch.Tensor], group: Dict[str, Any],
                decoupled: bool, moments: Tuple[torch.Tensor, ...], out: Tuple[torch.Tensor, ...],
                t: int, n: int) -> None:
    """This rank's Adam update of ``params`` (one param group, all at Adam step ``t``, laid
    end to end in ``g``), written over ``g`` (their gradients in, flat float32), and their next
    moments into ``out`` from ``moments``: Adam's ``m`` and ``v`` of this rank's gradient and
    ``w``, the slow mean of ``m_hat^2`` (module docstring), at ``n`` ranks. Elementwise: the
    bits of each parameter are those of updating it alone."""
    (m, v, w), (mn, vn, wn) = moments, out
    b1, b2 = group["betas"]
    lr, eps, wd = _scalar(group["lr"]), group["eps"], group["weight_decay"]
    if group.get("maximize", False):
        g.neg_()
    if wd and not decoupled:   # Adam's L2 decay joins the gradient
        parts = list(g.split([p.numel() for p in params]))
        torch._foreach_add_(parts, [p.detach().reshape(-1) for p in params], alpha=wd)
    torch.lerp(m, g, 1 - b1, out=mn)
    torch.mul(v, b2, out=vn).addcmul_(g, g, value=1 - b2)
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    # w' = b2 * w + (1 - b2) * (m' / bc1)^2, then the estimated second moment of the ranks'
    # average gradient, (v' / N + (1 - 1/N) * w') / bc2, in g.
    mh = torch.div(mn, bc1, out=g)
    torch.mul(w, b2, out=wn).addcmul_(mh, mh, value=1 - b2)
    est = torch.mul(wn, (1 - 1 / n) / bc2, out=g)
    est.add_(vn, alpha=1 / (n * bc2))
    # u = lr * m_hat / (sqrt(est) + eps), written over the estimate.
    denom = est.sqrt_().add_(eps)
    torch.div(mn, denom, out=denom).mul_(lr / bc1)


@torch.no_grad()
def rank_updates(gs: List[torch.Tensor], params: Sequence[torch.Tensor], group: Dict[str, Any],
                 decoupled: bool, moments: Tuple[List[torch.Tensor], ...],
                 out: Tuple[List[torch.Tensor], ...], t: int, n: int) -> None:
    """:func:`rank_update` for parameters each in tensors of its own (one param group, all at
    Adam step ``t``): ``gs`` their flat float32 gradients, ``moments`` and ``out`` lists of
    ``m``, ``v`` and ``w``. The same arithmetic, operation by operation, in torch's
    ``_foreach`` ops: a launch per operation, not per tensor."""
    if not gs:
        return
    (ms, vs, ws), (mns, vns, wns) = moments, out
    b1, b2 = group["betas"]
    lr, eps, wd = _scalar(group["lr"]), group["eps"], group["weight_decay"]
    if group.get("maximize", False):
        torch._foreach_neg_(gs)
    if wd and not decoupled:
        torch._foreach_add_(gs, [p.detach().reshape(-1) for p in params], alpha=wd)
    torch._foreach_copy_(mns, ms)
    torch._foreach_lerp_(mns, gs, 1 - b1)
    torch._foreach_copy_(vns, vs)
    torch._foreach_mul_(vns, b2)
    torch._foreach_addcmul_(vns, gs, gs, value=1 - b2)
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    torch._foreach_copy_(gs, mns)   # m_hat, in g
    torch._foreach_div_(gs, bc1)
    torch._foreach_copy_(wns, ws)
    torch._foreach_mul_(wns, b2)
    torch._foreach_addcmul_(wns, gs, gs, value=1 - b2)
    torch._foreach_copy_(gs, wns)   # the estimated second moment, in g
    torch._foreach_mul_(gs, (1 - 1 / n) / bc2)
    torch._foreach_add_(gs, vns, alpha=1 / (n * bc2))
    torch._foreach_sqrt_(gs)
    torch._foreach_add_(gs, eps)
    updates = torch._foreach_div(mns, gs)
    torch._foreach_mul_(updates, lr / bc1)
    torch._foreach_copy_(gs, updates)


@torch.no_grad()
def step_by(params: Sequence[torch.Tensor], deltas: Sequence[Optional[torch.Tensor]],
            group: Dict[str, Any], decoupled: bool, decay: bool = True) -> None:
    """Step ``params`` (one param group) by their delivered updates: AdamW's decoupled decay
    ``p *= 1 - lr * wd`` first (``decay``; every one of them), then ``p -= delta`` where a
    delta was delivered (None: the decay alone). One ``_foreach`` call for each."""
    params = list(params)
    if decay and group["weight_decay"] and decoupled and params:
        torch._foreach_mul_(params, 1 - _scalar(group["lr"]) * group["weight_decay"])
    moved = [(p, d.to(p.dtype)) for p, d in zip(params, deltas) if d is not None]
    if moved:
        torch._foreach_sub_([p for p, _ in moved], [d for _, d in moved])


def _runs(segs: Sequence[Tuple[Any, int]], flags: Sequence[bool], steps: Sequence[int]
          ) -> List[Tuple[int, int, int, int]]:
    """``(lo, hi, first, last)``: the bucket's coordinates ``[lo, hi)`` and segments
    ``[first, last)`` of each run of neighbouring segments alike in param group, in having a
    gradient (``flags``) and in Adam step (``steps``), so one set of hyperparameters serves a
    run."""
    out: List[Tuple[int, int, int, int]] = []
    prev = None
    for j, (s, gi) in enumerate(segs):
        key = (gi, flags[j], steps[j])
        if key == prev:
            out[-1] = (out[-1][0], s.offset + s.numel, out[-1][2], j + 1)
        else:
            out.append((s.offset, s.offset + s.numel, j, j + 1))
        prev = key
    return out


def altered(grad: torch.Tensor, delivered: torch.Tensor, scale: float) -> bool:
    """Whether ``grad`` is no longer the ``delivered`` update, nor that update unscaled by a
    known loss ``scale`` (a GradScaler's ``unscale_``, exact for a power of two): a clip.

    Read on a strided sample of about :data:`CHECKED` values: a norm clip (or an unscale_)
    multiplies every value, so any non-zero one it holds tells, where comparing the tensors
    whole read both at every step. A clip by value that changed no sampled value is missed."""
    stride = max(1, grad.numel() // CHECKED)
    g = grad.reshape(-1)[::stride]
    d = delivered.reshape(-1)[::stride].to(grad.dtype)
    if torch.equal(g, d):
        return False
    return not (scale != 1.0 and torch.equal(g, d / scale))


CHECKED = 4096   # values of each gradient that altered() compares


class WarnOnce:
    """A warning this process gives once. Check-and-set under a lock: the fake N-rank transport
    runs ranks as threads of one process, and a plain flag let two of them both warn."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.given = False
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            if self.given:
                return
            self.given = True
        log.warning(self.message)


CHANGED_AFTER_SYNC = WarnOnce(
    "hvd_slim: p.grad changed between synchronize() and step() (a GradScaler's unscale_, or a "
    "gradient clip). With adam_exchange='update' the exchange carries each rank's Adam update, "
    "already normalised, and step() applies it as delivered; clip before synchronize() to clip "
    "this rank's gradient, or pass adam_exchange='gradient' for Horovod's order. With a "
    "GradScaler, call optimizer.set_grad_scaler(scaler): its unscale_ is then expected, and its "
    "scale kept out of Adam's moments.")


def _decoupled(opt: torch.optim.Optimizer, group: Dict[str, Any]) -> bool:
    """AdamW's decay (torch 2.x: AdamW, or Adam with ``decoupled_weight_decay=True``)."""
    return isinstance(opt, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))


def _scalar(x: Any) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)
