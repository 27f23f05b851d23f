"""The local-steps grid's report (``--groups local-grid`` and ``local-steps``): final metric and
bytes for every (H, density, value bits) point that ran, the targets of local steps, and the
metric against bytes and against modelled wall time.

Wall time is *modelled* for a switched 1 Gbit/s cluster with 50 ms one-way latency (this
kernel has no netem, so no run could add the latency): the local steps up to an evaluation
point at one compute time per step, the same for every variant of a case (dense's measured
training seconds per step, mean over its seeds: rank 0, 4 ranks on 2 cores, its loopback
allreduce included), plus, for every exchange before the point, the wire time of one exchange
on that network. One compute time for all keeps the machine's load (which moved the runs' own
times by up to 2x) out of the comparison; hvd_slim's own CPU work per exchange (selection,
coding: milliseconds on these models) is left out, which flatters H = 1 most, where it comes
every step. The wire time of one exchange:

* hvd_slim (one server, rank 0): the gather brings N-1 pushes into the server's NIC, the
  pull's broadcast is a binomial tree of ceil(log2 N) rounds; a latency per message round:
  ``(2 + ceil(log2 N)) L + ((N-1) push + ceil(log2 N) pull) / rate``;
* dense data parallelism: a ring allreduce, ``2 (N-1) L + 2 (N-1)/N D / rate``.

With ``outer_delay=1`` a round's exchange runs during the next round's H local steps, so only
what it takes beyond their compute counts.

The pushes and pulls are the run's own counted bytes per exchange (rank 0's pull, another
rank's push is about the same size); D is the dense gradient's bytes.
"""
from __future__ import annotations

import math
import os
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

from .untuned import GRID_BITS, GRID_DENSITY, GRID_H, _mean, _metric, finish_axes

RATE_BPS = 1e9 / 8       # bytes per second on each host's NIC
LATENCY_S = 0.050        # one-way, added to every message round
TARGET = "local_steps=32 0.01 4-bit"
SPARSELOCO = TARGET + " decay=0.95 outer=sgd"
REFERENCES = ("dense", "default", "default local_steps=8", "local_steps=32 dense", TARGET,
              TARGET + " outer_delay=1", SPARSELOCO)
PLOTTED = ("dense", "local_steps=1 0.01 4-bit", "local_steps=8 0.01 4-bit", TARGET,
           TARGET + " outer_delay=1", SPARSELOCO, "local_steps=128 0.01 4-bit",
           "local_steps=32 0.001 4-bit",
           "local_steps=32 0.01 2-bit", "local_steps=32 dense")


def label(h: int, d: float, b: int) -> str:
    return f"local_steps={h} {d} {b}-bit"


def wire_seconds(run: Dict[str, Any], steps: float, pushed: float, pulled: float,
                 compute: float = 0.0) -> float:
    """Modelled wire time of ``steps`` local steps' exchanges (see the module docstring)."""
    n = run.get("world_size", 4)
    tree = math.ceil(math.log2(n)) if n > 1 else 0
    if run["method"] == "dense":
        dense = run["records"][-1]["dense_bytes"] / max(run["records"][-1]["steps"], 1)
        return steps * (2 * (n - 1) * LATENCY_S + 2 * (n - 1) / n * dense / RATE_BPS)
    slim = run.get("slim") or {}
    h = slim.get("local_steps", 1)
    exchanges = steps / h
    per_push = pushed / max(exchanges, 1e-12)
    per_pull = pulled / max(exchanges, 1e-12)
    one = (2 + tree) * LATENCY_S + ((n - 1) * per_push + tree * per_pull) / RATE_BPS
    if slim.get("outer_delay"):   # hidden behind the next round's compute, up to its length
        one = max(0.0, one - h * compute)
    return exchanges * one


def compute_per_step(runs: List[Dict[str, Any]], case: str) -> float:
    """Dense's measured training seconds per step on ``case`` (mean over its seeds)."""
    dense = [r["records"][-1] for r in runs if r.get("case") == case
             and r.get("variant") == "dense" and r.get("records")]
    return _mean([x["wall_seconds"] / x["steps"] for x in dense])


def curve(run: Dict[str, Any], compute: float) -> List[Tuple[float, float, float]]:
    """(MB pushed + pulled, modelled seconds, metric) at each evaluation point, at
    ``compute`` seconds a step."""
    from .time_to_accuracy import points
    m = _metric(run)
    return [((p["bytes_pushed"] + p["bytes_pulled"]) / 1e6,
             p["steps"] * compute + wire_seconds(run, p["steps"], p["bytes_pushed"],
                                                 p["bytes_pulled"], compute), p[m])
            for p in points(run)]


def summarise(runs: List[Dict[str, Any]], case: str) -> "OrderedDict[str, Dict[str, Any]]":
    """Per variant of ``case``: seeds, final metric (mean), bytes per local step and the
    modelled seconds of the whole run."""
    by: "OrderedDict[str, List[Dict[str, Any]]]" = OrderedDict()
    for r in runs:
        if r.get("case") == case and r.get("records") and not r.get("diverged"):
            by.setdefault(r["variant"], []).append(r)
    out: "OrderedDict[str, Dict[str, Any]]" = OrderedDict()
    compute = compute_per_step(runs, case)
    for variant, rs in by.items():
        last = [r["records"][-1] for r in rs]
        m = _metric(rs[0])
        out[variant] = {
            "seeds": len(rs), "metric": m, "end": _mean([x[m] for x in last]),
            "by_seed": {r["seed"]: r["records"][-1][m] for r in rs},
            "pushed": _mean([x["bytes_pushed"] / x["steps"] for x in last]),
            "pulled": _mean([x["bytes_pulled"] / x["steps"] for x in last]),
            "dense": _mean([x["dense_bytes"] / x["steps"] for x in last]),
            "modelled": _mean([curve(r, compute)[-1][1] for r in rs]), "compute": compute,
            "load": _mean([r.get("loadavg", [float("nan")])[0] for r in rs]), "runs": rs}
    return out


def _cell(row: Optional[Dict[str, Any]]) -> str:
    if row is None:
        return "–"
    fmt = "{:.3f}" if row["metric"] == "val_bpb" else "{:.2f}"
    return f"{fmt.format(row['end'])} ({row['dense'] / row['pushed']:,.0f}x)"


def grid_table(rows: "OrderedDict[str, Dict[str, Any]]") -> str:
    """The metric at the end (and dense bytes over pushed bytes, per local step) per
    (density, H) and value bits; – where the point did not run."""
    out = ["| density | H | " + " | ".join(f"{b}-bit" for b in GRID_BITS) + " |",
           "|---|---:|" + "---:|" * len(GRID_BITS)]
    for d in GRID_DENSITY:
        for h in GRID_H:
            cells = [_cell(rows.get(label(h, d, b))) for b in GRID_BITS]
            out.append(f"| {d} | {h} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def references_table(rows: "OrderedDict[str, Dict[str, Any]]") -> str:
    """Dense, the defaults, DiLoCo's own exchange at H = 32 and the target point (waited for
    and delayed): metric against dense on the same seeds, bytes and modelled wall time."""
    dense = rows.get("dense")
    if dense is None:
        return ""
    lower = dense["metric"] == "val_bpb"
    out = ["| run | seeds | metric | vs dense | pushed B/local step | x fewer than dense "
           "| modelled s (1 Gbit/s, 50 ms) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for v in REFERENCES:
        r = rows.get(v)
        if r is None:
            continue
        ref = _mean([dense["by_seed"][s] for s in r["by_seed"] if s in dense["by_seed"]])
        gap = f"{100 * (r['end'] / ref - 1):+.2f}%" if lower else f"{r['end'] - ref:+.2f}"
        out.append(f"| {v} | {r['seeds']} | {r['end']:.4g} | {gap} | {r['pushed']:,.0f} "
                   f"| {r['dense'] / r['pushed']:,.0f}x | {r['modelled']:,.0f} |")
    return "\n".join(out) + "\n"


def time_to_dense(rows: "OrderedDict[str, Dict[str, Any]]") -> str:
    """Modelled seconds until each reference first reaches dense's final metric, and until
    it reaches the H = 1 defaults' (the issue's two comparisons)."""
    out = []
    for ref_name in ("dense", "default"):
        ref = rows.get(ref_name)
        if ref is None:
            continue
        goal, lower = ref["end"], ref["metric"] == "val_bpb"
        # Its seeds' mean is not reached by every seed: then its whole run's time.
        t_ref = _first_hit(ref, goal, lower) or ref["modelled"]
        for v in REFERENCES:
            r = rows.get(v)
            if r is None or v == ref_name or (ref_name == "default" and v == "dense"):
                continue
            t = _first_hit(r, goal, lower)
            if t is None:
                out.append(f"- {v}: does not reach {ref_name}'s final {goal:.4g} (it ends at "
                           f"{r['end']:.4g}).")
            else:
                out.append(f"- {v}: reaches {ref_name}'s final {goal:.4g} at {t:,.0f} s "
                           f"modelled, {ref_name} at {t_ref:,.0f} s ({t_ref / t:.2f}x).")
    return "\n".join(out) + "\n"


def _first_hit(r: Dict[str, Any], goal: float, lower: bool) -> Optional[float]:
    """Mean over seeds of the first modelled time at ``goal`` (None: a seed never got there)."""
    times = []
    for run in r["runs"]:
        hit = [t for _, t, y in curve(run, r["compute"]) if (y <= goal if lower else y >= goal)]
        times.append(hit[0] if hit else None)
    return None if None in times else _mean(times)


def plot(rows: "OrderedDict[str, Dict[str, Any]]", case: str, out: str) -> List[str]:
    """The metric against MB pushed + pulled, and against modelled seconds, for the
    PLOTTED variants (seed 0 where there are several)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    from .time_to_accuracy import save_figure
    written = []
    for axis, name, xlabel in ((0, "bytes", "MB pushed + pulled by rank 0 (cumulative, log)"),
                               (1, "seconds", "modelled seconds: 1 Gbit/s switched, 50 ms "
                                              "latency (measured compute)")):
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for v in PLOTTED:
            r = rows.get(v)
            if r is None:
                continue
            pts = curve(r["runs"][0], r["compute"])
            style = {"color": "black", "linewidth": 2} if v == "dense" else {}
            ax.plot([p[axis] for p in pts], [p[2] for p in pts], marker="o", markersize=3,
                    label=v, **style)
        if axis == 0:
            ax.set_xscale("log")
        finish_axes(ax, case, xlabel, f"{case}: local steps, 4 ranks (seed 0)", legend=7)
        written.append(save_figure(fig, os.path.join(out, f"local_grid_{case}_vs_{name}.png")))
    return written


def report(runs: List[Dict[str, Any]], out: str) -> str:
    """Write ``local_grid.md`` and its plots into ``out``; return the text."""
    parts, written = [], []
    for case, title in (("sgd-m0.5", "MNIST, Horovod's example script (test accuracy %)"),
                        ("lm", "language model (validation bits per byte)")):
        rows = summarise(runs, case)
        if not any(k.startswith("local_steps=") for k in rows):
            continue
        parts += [f"## Local steps: {title}\n\n", grid_table(rows), "\n", references_table(rows),
                  "\nTime to dense's and to the defaults' final metric (modelled):\n\n",
                  time_to_dense(rows)]
        loads = [r["load"] for r in rows.values() if r["load"] == r["load"]]
        if loads and "dense" in rows:   # a screen's output may hold no dense run
            parts.append(f"\nModelled compute: {rows['dense']['compute']:.3f} s a step "
                         f"(dense's measured). Machine load (1-minute average at the runs' "
                         f"start): {min(loads):.1f} to {max(loads):.1f}.\n\n")
        written += plot(rows, case, out)
    if not parts:
        return ""
    text = "".join(parts)
    with open(os.path.join(out, "local_grid.md"), "w", encoding="utf-8") as f:
        f.write(text)
    return text + "".join(f"\nwrote {p}" for p in written)
