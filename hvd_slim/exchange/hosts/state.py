"""The checkpointed state of ``hierarchical=True`` (exchange/hosts/hierarchy.py): this rank's piece
of its host's exchange, its carry (its own gradient of a failed step that no host reduction
took in yet, added to the next one), and its step count: a rank whose pieces are all empty has
no cross exchange to hold it, yet its count must agree with the others' (the handshake compares
them, and ``overlap`` takes its count from the first stage, where a small stage leaves some
ranks without a piece)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict

import torch

from .. import checkpoint
from ..layout import SPARSE

if TYPE_CHECKING:   # pragma: no cover
    from .hierarchy import HierarchicalExchange


def held_residuals(ex: "HierarchicalExchange") -> Dict[int, torch.Tensor]:
    """:meth:`SlimExchange.held_residuals` in the units of a flat exchange: this rank's pieces
    of its host's residuals (and of the server's), times the host's ranks under
    ``op="average"`` (a host residual is of the host's mean), plus its carry."""
    out = {b.index: torch.zeros(b.numel, dtype=torch.float64) for b in ex.layout.sparse}
    for i, c in ex.host_phases.carry.items():
        out[i] += c.double()
    if ex.inner is None:
        return out
    scale = ex.local_size if ex.cfg.op == "average" else 1
    name_of = {name: i for i, (name, _) in ex.pieces.items()}
    held = ex.inner.held_residuals()
    for ib in ex.inner.layout.sparse:
        i = name_of[ib.segments[0].name]
        lo, hi = ex.bounds[i][ex.local_rank:ex.local_rank + 2]
        out[i][lo:hi] += held[ib.index].cpu() * scale
    return out


def where(ex: "HierarchicalExchange") -> dict:
    return {"hosts": ex.hosts, "local_size": ex.local_size, "local_rank": ex.local_rank}


def state_of(ex: "HierarchicalExchange") -> dict:
    """This rank's piece of its host's exchange state, where it sits, and its carry."""
    return {"version": checkpoint.VERSION, "rank": ex.rank, "size": ex.size,
            "hierarchical": where(ex), "step": ex.step_count,
            "inner": ex.inner.state_dict() if ex.inner is not None else None,
            # Without pieces the figures are this rank's own (else in the inner's state).
            "stats": ex.stats.state_dict() if ex.inner is None else None,
            "carry": {i: c.clone() for i, c in ex.host_phases.carry.items()},
            # in true units (a told loss scale divided out); absent: at a failed step's scale
            "carry_unscaled": True}


def validate(ex: "HierarchicalExchange", state: dict) -> None:
    """Raise ValueError, naming what differs, unless ``state`` loads on ``ex``."""
    here = where(ex)
    if not isinstance(state, dict) or "hierarchical" not in state:
        raise ValueError("hvd_slim checkpoint was made without hierarchical=True (a flat "
                         "exchange's state); resume with the keywords it was saved with")
    if state.get("rank") != ex.rank or state.get("size") != ex.size \
            or state["hierarchical"] != here:
        raise ValueError(f"hvd_slim checkpoint holds rank {state.get('rank')} of "
                         f"{state.get('size')} at {state['hierarchical']}; this is rank "
                         f"{ex.rank} of {ex.size} at {here}. {checkpoint.FIX_RANK}")
    carry = state.get("carry", {})   # absent in checkpoints of before the carry: none
    buckets = {b.index: b for b in ex.layout.buckets if b.kind == SPARSE}
    if not isinstance(carry, dict):
        raise ValueError("hvd_slim checkpoint: 'carry' must map bucket indices to tensors")
    if carry and not state.get("carry_unscaled", False) and ex.layout.loss_scale.told:
        raise ValueError("hvd_slim checkpoint: its carry (the gradient of a failed step that "
                         "no host reduction took in yet) was saved by an hvd_slim that kept it "
                         "at that step's loss scale without recording the scale, and a "
                         "GradScaler is told now: resume from a checkpoint saved after a step "
                         "that went through, or save it again with this version")
    for i, c in carry.items():
        b = buckets.get(i)
        if b is None or not isinstance(c, torch.Tensor) or c.dtype != b.dtype \
                or c.shape != (b.numel,):
            raise ValueError(f"hvd_slim checkpoint: the carry of bucket {i!r} does not fit "
                             "this model's compressed buckets; resume with the same model")
    step = state.get("step", 0)   # absent in checkpoints of before it was saved: 0, as then
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"hvd_slim checkpoint: step must be an integer >= 0, got {step!r}")
    if ex.inner is not None:
        ex.inner.validate_state_dict(state.get("inner"))
        if "step" in state and state["inner"].get("step") != step:
            raise ValueError(f"hvd_slim checkpoint: step {step} but its cross exchange's "
                             f"step {state['inner'].get('step')!r}; the checkpoint is damaged")
    elif not isinstance(state.get("stats") or {}, dict):
        raise ValueError("hvd_slim checkpoint: 'stats' must be a dict of figures")


def load(ex: "HierarchicalExchange", state: dict) -> int:
    """Validate, then load ``state`` into ``ex``'s cross exchange (or, without pieces, its
    figures) and carry; a refused state changes nothing. Returns the saved step count, which a
    rank without pieces keeps itself."""
    validate(ex, state)
    if ex.inner is not None:
        ex.inner.load_state_dict(state["inner"])
    else:
        ex.stats.load_state_dict(state.get("stats") or {})
    ex.host_phases.carry = {i: c.detach().cpu().clone()
                            for i, c in state.get("carry", {}).items()}
    return state.get("step", 0)
