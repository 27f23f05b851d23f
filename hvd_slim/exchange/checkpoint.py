"""Checkpointing one rank's exchange: what is saved, and a load that validates everything first.

A checkpoint is refused, with a message naming what differs, when it comes from another rank or
job size, another model (the first differing parameter is named) or other Slim-DP settings (the
first differing field; ``timeout`` and ``nonfinite`` may change on resume). Everything is
checked before anything is written, so a refused checkpoint leaves the optimizer untouched. The
state holds only tensors and plain Python values: ``torch.load(..., weights_only=True)`` reads it.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict

import torch

from ..config import RESUMABLE_FIELDS
from .describe import config_difference, param_difference, params_of
from .layout import DENSE
from .warmup import Schedule

if TYPE_CHECKING:   # step.py imports this module
    from .step import SlimExchange

# What fields added later meant before they existed: a checkpoint without one was made with
# that behaviour (values at full precision, DGC's masking, decays from dense).
OLD_FIELDS = {"adam_variance": "auto", "momentum_masking": 1.0, "value_bits": 32,
              "warmup_start_density": 1.0, "servers": 1, "hierarchical": False,
              "overlap": 1, "local_steps": 1, "outer_delay": 0, "residual_decay": 1.0,
              "adam_exchange": "gradient", "warmup_settle": None}
# Fields added after version 3's "effective" record: a record without one predates it.
LATER_FIELDS = {"servers": 1, "hierarchical": False, "overlap": 1, "local_steps": 1,
                "outer_delay": 0, "residual_decay": 1.0, "adam_exchange": "gradient",
                "warmup_settle": None}

# 3: adds "effective", the settings in force (automatic fields resolved); 4: no cached cores
# (refresh_interval is gone: every step selects anew, so the cores of older states are ignored)
VERSION = 4
FIX_RANK = ("Residuals are per rank: save every rank's optimizer.state_dict() (e.g. to "
            "f'ckpt-{hvd.rank()}.pt') and load each rank's own; for one shared file, call "
            "optimizer.flush() and drop the 'hvd_slim' entry before saving")


def _where(keys: list) -> str:
    return " and ".join(keys)


def state_of(ex: SlimExchange) -> dict:
    """This rank's exchange state (see :meth:`SlimExchange.state_dict`)."""
    return {"version": VERSION, "rank": ex.rank, "size": ex.size, "step": ex.step_count,
            "ranks": list(ex.ranks), "in_set": ex.in_set, "digest": ex.digest, "config": ex.cfg.to_dict(),
            "effective": ex.cfg.effective_dict(), "layout": ex.layout.description(),
            "memory": {i: m.state_dict() for i, m in ex.worker.memory.items()},
            "selector": {i: s.state_dict() for i, s in ex.worker.selector.items()},
            "servers": ex.servers,
            "server": None if ex.server is None else ex.server.state_dict(),
            "stats": ex.stats.state_dict(), "warmup": ex.layout.schedule.state_dict()}


def residual_norm(ex: SlimExchange) -> float:
    """:meth:`SlimExchange.residual_norm`."""
    total = sum(float(m.residual.double().pow(2).sum()) for m in ex.worker.memory.values())
    if ex.server is not None:
        total += sum(float(m.residual.double().pow(2).sum()) for m in ex.server.memory.values())
    return total


def held_residuals(ex: SlimExchange) -> Dict[int, torch.Tensor]:
    """:meth:`SlimExchange.held_residuals`."""
    return _held(ex, 1.0)


def held_as_pushes(ex: SlimExchange) -> Dict[int, torch.Tensor]:
    """:meth:`SlimExchange.held_as_pushes`."""
    cfg = ex.cfg
    # The server's residual sums pushes times its scale (op average: predivide / N).
    return _held(ex, 1.0 if cfg.op == "sum" else ex.size / cfg.gradient_predivide_factor)


def _held(ex: SlimExchange, server_factor: float) -> Dict[int, torch.Tensor]:
    """Per compressed bucket, this rank's worker residual plus, on a server, its shard's pieces
    of the server residual times ``server_factor``, as float64 vectors."""
    # A copy: .double() of a float64 residual is the residual itself, which the server's
    # pieces would then be added into.
    out = {i: m.residual.to(torch.float64, copy=True) for i, m in ex.worker.memory.items()}
    if ex.server is not None:
        for piece in ex.shards.by_shard(None)[ex.shard]:
            mem = ex.server.memory.get(piece.b.index)
            if mem is not None:
                i = ex.layout.buckets[piece.bucket].index
                out[i][piece.lo:piece.hi] += mem.residual.double() * server_factor
    return out


def validate(ex: SlimExchange, state: Any) -> None:
    """Raise ValueError (naming what differs and how to fix it) unless ``state`` can be loaded
    into ``ex`` completely. Reads only."""
    if not isinstance(state, dict) or state.get("version") not in (1, 2, 3, VERSION):
        got = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"hvd_slim checkpoint: unknown format version {got!r}; expected the "
                         "'hvd_slim' entry of an hvd_slim optimizer.state_dict()")
    _check_same_exchange(ex, state)
    _check_same_ranks(ex, state)
    if state.get("size") != ex.size or state.get("rank") != ex.rank:
        raise ValueError(f"hvd_slim checkpoint holds the residuals of rank {state.get('rank')} "
                         f"of {state.get('size')}; this is rank {ex.rank} of {ex.size}. {FIX_RANK}")
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"hvd_slim checkpoint: step must be an integer >= 0, got {step!r}")
    saved_servers = state.get("servers", 1)
    if saved_servers != ex.servers:
        raise ValueError(f"hvd_slim checkpoint was made with {saved_servers} server shard(s); "
                         f"this exchange has {ex.servers} (servers={ex.cfg.servers!r}). Shards "
                         "hold different server residuals: resume with the same servers value "
                         "and world size, or call optimizer.flush() before saving and load "
                         "without the 'hvd_slim' entry")
    for b in ex.layout.sparse:
        mem = _entry(state, "memory", b.index)
        _tensor(mem, "residual", (b.numel,), b.dtype, b.index)
        if ex.worker.memory[b.index].velocity is not None:
            _tensor(mem, "velocity", (b.numel,), b.dtype, b.index)
        elif "velocity" in mem:
            raise ValueError(f"hvd_slim checkpoint: bucket {b.index} has a momentum-correction "
                             "velocity but this optimizer has none: load it with the same "
                             "optimizer (SGD momentum) and momentum_correction setting")
    # Selectors are kept per piece (one per shard; the bucket itself with one server).
    for pb in ex.shards.piece_sizes(None).values():
        if pb.kind == DENSE:
            continue
        _threshold(_entry(state, "selector", pb.index), pb.index)
    if ex.server is not None:
        _check_server(ex, state.get("server"))
    if not isinstance(state.get("stats", {}), dict):
        raise ValueError("hvd_slim checkpoint: 'stats' must be a dict")
    if ex.cfg.warmup_settle is not None:   # (the same settings: saved with the schedule's state)
        Schedule.check_state(state.get("warmup"))


def load(ex: SlimExchange, state: dict) -> None:
    """Copy a :func:`validate`-d state into ``ex``."""
    ex.step_count = int(state["step"])
    for i, m in ex.worker.memory.items():
        m.load_state_dict(state["memory"][i])
    for i, sel in ex.worker.selector.items():
        sel.load_state_dict(state["selector"][i])
    if ex.server is not None:
        ex.server.load_state_dict(state["server"])
    ex.stats.load_state_dict(state.get("stats", {}))
    if ex.cfg.warmup_settle is not None:
        ex.layout.schedule.load_state_dict(state["warmup"])


# --- checks ------------------------------------------------------------------------------------
def _check_same_exchange(ex: SlimExchange, state: dict) -> None:
    """Same model (by layout description when saved, else by digest) and same settings."""
    saved_cfg = _saved_effective(state)
    cfg_diff = config_difference({"in the checkpoint": saved_cfg, "now": ex.cfg.effective_dict()},
                                 _where, ignore=RESUMABLE_FIELDS)
    if cfg_diff:
        raise ValueError(f"hvd_slim checkpoint was made with other Slim-DP settings: {cfg_diff}. "
                         "Resume with the same DistributedOptimizer keywords and HVD_SLIM_* "
                         "variables (only timeout and nonfinite may change)")
    if "layout" in state:
        try:
            saved = params_of({"params": state["layout"]})
        except ValueError as exc:
            raise ValueError(f"hvd_slim checkpoint: unreadable layout ({exc})") from None
        now = params_of({"params": ex.layout.description()})
        diff = param_difference({"in the checkpoint": saved, "now": now}, _where)
        if diff:
            raise ValueError(f"hvd_slim checkpoint was made with a different model: {diff}. "
                             "Load it into the model it was saved from")
    elif state.get("digest") != ex.digest:
        raise ValueError("hvd_slim checkpoint was made with a different model or Slim-DP "
                         f"config: saved {saved_cfg}, now {ex.cfg.to_dict()}")


def _check_same_ranks(ex: SlimExchange, state: dict) -> None:
    """A checkpoint made inside a process set loads only into an exchange among the same job
    ranks. (Checkpoints without "ranks" come from before process sets: the whole job.)"""
    size = state.get("size")
    saved = state.get("ranks", list(range(size)) if isinstance(size, int) else None)
    if saved == ex.ranks or not (state.get("in_set") or ex.in_set):
        return   # the same ranks, or both span a whole job (the size check names the sizes)
    raise ValueError(f"hvd_slim checkpoint was saved by an exchange among the job ranks {saved}; "
                     f"this optimizer exchanges among {ex.ranks}. Resume with the same "
                     f"process_set (the same job ranks). {FIX_RANK}")


def _saved_effective(state: dict) -> Any:
    """The settings in force when ``state`` was saved (automatic fields resolved as they were
    then: before version 3 a default pull was ``max(d, min(4d, 0.004))``)."""
    if isinstance(state.get("effective"), dict):
        saved = {**LATER_FIELDS, **state["effective"]}
        # pull_value_bits came later: before it, the pull's slice was at value_bits.
        saved.setdefault("pull_value_bits", saved.get("value_bits"))
        return _without_retired(saved)
    saved = state.get("config")
    if not isinstance(saved, dict):
        return saved
    out = {**OLD_FIELDS, **saved}
    if out.get("pull_value_bits") is None:   # None, or from before it: the push's bits
        out["pull_value_bits"] = out.get("value_bits")
    d = out.get("density")
    if out.get("pull_density") is None and isinstance(d, (int, float)):
        out["pull_density"] = max(d, min(4 * d, 0.004))
    if not out.get("warmup_decay_steps"):
        out["warmup_start_density"] = None
    return _without_retired(out)


def _without_retired(saved: Dict[str, Any]) -> Dict[str, Any]:
    """``saved`` less the settings hvd_slim no longer has. ``refresh_interval`` at its only
    kept value (1: a fresh core every step) is what every exchange does now; a run that cached
    cores for several steps cannot be resumed bitwise by one that does not."""
    out = dict(saved)
    q = out.pop("refresh_interval", 1)
    if q != 1:
        raise ValueError(f"hvd_slim checkpoint was made with refresh_interval={q!r}, which "
                         "hvd_slim no longer has (docs/keywords.md, 'Removed'). "
                         "Call optimizer.flush() in the run that saved it, or load the "
                         "checkpoint without its 'hvd_slim' entry")
    return out


def _entry(state: dict, key: str, index: int) -> Dict[str, Any]:
    table = state.get(key)
    if not isinstance(table, dict) or not isinstance(table.get(index), dict):
        raise ValueError(f"hvd_slim checkpoint lacks {key} of bucket {index}")
    return table[index]


def _tensor(d: dict, key: str, shape: tuple, dtype: torch.dtype, index: int) -> None:
    t = d.get(key)
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
        got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else repr(type(t))
        raise ValueError(f"hvd_slim checkpoint: bucket {index} {key} is {got}, expected "
                         f"{shape} {dtype}")


def _threshold(d: dict, index: int) -> None:
    thr = d.get("threshold")
    if thr is not None and (not isinstance(thr, (int, float)) or not math.isfinite(thr)):
        raise ValueError(f"hvd_slim checkpoint: bucket {index} selector threshold {thr!r} is "
                         "not a finite number")


def _check_server(ex: SlimExchange, srv: Any) -> None:
    if not isinstance(srv, dict):
        raise ValueError(f"rank {ex.rank} is the server but its checkpoint has no server state: "
                         "was server_rank changed?")
    for b in ex.server.layout.sparse:   # this server's pieces (its shard)
        _tensor(_entry(srv, "memory", b.index), "residual", (b.numel,), b.dtype, b.index)
        _threshold(_entry(srv, "selector", b.index), b.index)
