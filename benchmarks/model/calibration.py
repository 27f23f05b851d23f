"""Which calibration run stands for a results file's local work, and how much faster or slower
the file's sitting ran the same CPU work (the load index): benchmarks/model/validate.py's
inputs from ``--local-from`` (its docstring gives the rules)."""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .inputs import Inputs, inputs_of

__all__ = ["Calibration", "calibration_for", "floor_median", "load_calibration", "load_index",
           "selection_s", "succeeded"]


@dataclass
class Calibration:
    """A calibration run's results and its scenario (the network its communication is
    modelled on)."""

    path: str
    res: Dict[str, Any]
    inputs: Inputs


def load_calibration(path: str) -> Calibration:
    with open(path, encoding="utf-8") as f:
        res = json.load(f)
    return Calibration(path, res, inputs_of(res))


def _key(res: Dict[str, Any]) -> Tuple[str, int, int]:
    settings = res.get("settings", {})
    return (str(settings.get("model")), int(settings.get("ranks", 0)),
            int(settings.get("ranks_per_host") or 1))


def _named(key: Tuple[str, int, int]) -> str:
    per_host = f", {key[2]} per host" if key[2] != 1 else ""
    return f"model {key[0]!r}, {key[1]} ranks{per_host}"


def calibration_for(res: Dict[str, Any], calibs: Sequence[Calibration],
                    path: str = "results") -> Calibration:
    """The one calibration with the same ``settings.model``, ``settings.ranks`` and
    ``settings.ranks_per_host`` (hosts of several ranks: ``hierarchical=True`` does other work)
    as ``res``; ValueError when there is none or more than one."""
    want = _key(res)
    hits = [c for c in calibs if _key(c.res) == want]
    if len(hits) != 1:
        have = ", ".join(f"{c.path} ({_named(_key(c.res))})" for c in calibs) or "none"
        what = "no calibration" if not hits else f"{len(hits)} calibrations"
        raise ValueError(f"{what} for {path} ({_named(want)}) among --local-from: {have}")
    return hits[0]


def succeeded(p: Dict[str, Any]) -> bool:
    """Whether a peer's record ran and has a step time."""
    return p.get("status") == "ok" and bool(p.get("median_s"))


def selection_s(p: Dict[str, Any]) -> Optional[float]:
    """A peer's measured selection seconds per step (None: it timed none)."""
    sel = p.get("select_ms_per_step")
    return None if sel is None else sel / 1e3


def floor_median(res: Dict[str, Any]) -> float:
    """A results file's floor median (0: it ran none)."""
    p = res.get("peers", {}).get("floor") or {}
    return float(p["median_s"]) if succeeded(p) else 0.0


def _same_selector(peer: str, res: Dict[str, Any], calib: Calibration) -> bool:
    """Whether both runs timed the same selection code for ``peer``: hvd_slim's own selector
    (``machine.hvd_slim_sha256``) or torch.topk (``machine.torch``)."""
    key = "hvd_slim_sha256" if peer.startswith("hvd_slim") else "torch"
    mine, theirs = (res.get("machine") or {}).get(key), (calib.res.get("machine") or {}).get(key)
    return mine == theirs


def load_index(res: Dict[str, Any], calib: Calibration) -> Tuple[float, List[str]]:
    """(The file's load index, the peers it is the median over): the median over the peers that
    ran in both files with a selection timed in both, by the same code, of (its selection here
    / there); 1.0 when no peer has one."""
    cal_peers = calib.res.get("peers", {})
    ratios: Dict[str, float] = {}
    for name, p in res.get("peers", {}).items():
        c = cal_peers.get(name) or {}
        here = selection_s(p) if succeeded(p) else None
        there = selection_s(c) if succeeded(c) else None
        if here and there and _same_selector(name, res, calib):
            ratios[name] = here / there
    if not ratios:
        return 1.0, []
    return statistics.median(ratios.values()), sorted(ratios)
