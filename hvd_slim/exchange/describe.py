"""What a rank's exchange is made of (parameters and settings), and where two of them differ.

Ranks compare these descriptions when their digests disagree (handshake.py), and a checkpoint
is compared with the running optimizer the same way (checkpoint.py), so both can name the first
differing parameter or config field instead of reporting a bare hash mismatch.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence

from ..config import SlimConfig
from .layout import Layout

DESCRIPTION_VERSION = 1


def rank_description(layout: Layout, config: SlimConfig, rank: int, step: int, digest: int,
                     scaled: bool = False) -> dict:
    """A JSON-ready description of one rank's exchange; ``scaled``: it was told a GradScaler
    (named as a config field, ``set_grad_scaler``, where ranks differ)."""
    shared = config.shared_dict()
    if scaled:
        shared["set_grad_scaler"] = "given"
    return {"version": DESCRIPTION_VERSION, "rank": rank, "step": step,
            "digest": f"{digest:016x}", "config": shared, "params": layout.description()}


def ranks_text(ranks: Sequence[int]) -> str:
    """``on rank 3`` or ``on ranks 0, 2``."""
    ranks = sorted(ranks)
    return ("on rank " if len(ranks) == 1 else "on ranks ") + ", ".join(map(str, ranks))


def grouped(values: Dict[Hashable, str], where: Callable[[List[Any]], str]) -> str:
    """``v1 <where(keys1)> vs. v2 <where(keys2)>`` (e.g. "... on ranks 0, 2 vs. ... on rank 1"):
    keys grouped by value, the group of the first key first (rank 0's view leads)."""
    groups: Dict[str, List[Any]] = {}
    for key, value in values.items():
        groups.setdefault(value, []).append(key)
    position = {key: i for i, key in enumerate(values)}
    order = sorted(groups.items(), key=lambda kv: min(position[k] for k in kv[1]))
    return " vs. ".join(f"{value} {where(keys)}" for value, keys in order)


def _signature(row: Optional[list]) -> str:
    if row is None:
        return "absent"
    _, shape, dtype, sent_as, status = row
    text = f"shape {tuple(shape)} {dtype}"
    if status == "frozen":
        return f"frozen (requires_grad=False), {text}"
    return text + (f" sent as {sent_as}" if sent_as and sent_as != dtype else "")


def params_of(desc: Any) -> Dict[str, list]:
    """name -> row of a description's parameters; ValueError when the structure is wrong."""
    rows = desc.get("params") if isinstance(desc, dict) else None
    if not isinstance(rows, list):
        raise ValueError("no parameter list")
    out = {}
    for row in rows:
        ok = (isinstance(row, list) and len(row) == 5 and isinstance(row[0], str)
              and isinstance(row[1], list) and all(isinstance(x, int) for x in row[1])
              and all(isinstance(x, str) for x in row[2:]))
        if not ok:
            raise ValueError(f"malformed parameter entry {str(row)[:80]}")
        out[row[0]] = row
    return out


RESOLVED = ("pull_density", "warmup_decay_steps", "warmup_start_density")
# The settings that choose other settings' defaults (SlimConfig.mode_sources).
MODES = ("local_steps", "adam_exchange")


def config_difference(configs: Dict[Hashable, Any], where: Callable[[List[Any]], str],
                      ignore: Sequence[str] = ()) -> Optional[str]:
    """``config field 'density': 0.01 on ... vs. 0.05 on ...`` for the first field (in the order of
    :class:`SlimConfig`'s fields, the modes first and the automatic ones last) whose values
    differ, or None."""
    names = list(SlimConfig.__dataclass_fields__)
    for cfg in configs.values():
        names += [k for k in (cfg if isinstance(cfg, dict) else {}) if k not in names]
    # An automatic field resolves from the others: name the setting that differs, not its echo;
    # and a mode first, whose defaults (config/settings.py) make the others differ too.
    names = [n for n in MODES if n in names] + \
        [n for n in names if n not in RESOLVED and n not in MODES] + \
        [n for n in names if n in RESOLVED]
    for name in names:
        if name in ignore:
            continue
        values = {key: repr(cfg.get(name, "<unset>")) if isinstance(cfg, dict) else "<none>"
                  for key, cfg in configs.items()}
        if len(set(values.values())) > 1:
            return f"config field {name!r}: {grouped(values, where)}"
    return None


def param_difference(params: Dict[Hashable, Dict[str, list]],
                     where: Callable[[List[Any]], str]) -> Optional[str]:
    """``parameter 'fc.weight': shape ... on ... vs. ...`` for the first parameter, by name, that
    differs (shape, dtype, comm dtype, frozen or absent), plus a count of the others."""
    names = sorted(set().union(*(p.keys() for p in params.values())))
    differing = [n for n in names
                 if len({_signature(p.get(n)) for p in params.values()}) > 1]
    if not differing:
        return None
    first = differing[0]
    text = f"parameter {first!r}: " + grouped(
        {key: _signature(p.get(first)) for key, p in params.items()}, where)
    if len(differing) > 1:
        others = ", ".join(repr(n) for n in differing[1:4])
        text += (f" (and {len(differing) - 1} more parameter(s) differ: {others}"
                 + (", ..." if len(differing) > 4 else "") + ")")
    return text


def stages_text(cuts: Any) -> str:
    """``(first..last; ...)``: the first and last parameter of each stage of ``overlap``'s cut
    (a checkpoint's, which may be malformed: then ``?``)."""
    if not isinstance(cuts, list):
        return ""
    return "(" + "; ".join(f"{c[0]}..{c[-1]}" if isinstance(c, list) and c else "?"
                           for c in cuts) + ")"
