"""Summaries, a markdown table and plots of sweep results (sweep.py's JSON lines).

``write_report(runs, out, target_gap)`` groups runs by (dataset, config), averages over seeds,
writes ``table.md`` and, with matplotlib, ``<dataset>_accuracy_vs_epoch.png`` and
``<dataset>_accuracy_vs_bytes.png`` into ``out``, and returns the table. Runs carry the
network they ran on (``net``, loopback when absent); a run on another network is its own row,
labelled ``<config> @<net>`` and compared with dense on the same network. With
``tta_target`` (e.g. ``{"mnist": 98.5}``) it adds, per dataset and network, a table of the
time to that accuracy from the runs whose evaluations are timed
(time_to_accuracy.py).
"""
from __future__ import annotations

import os
import statistics
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

from . import time_to_accuracy as tta
from .time_to_accuracy import points as _points

Runs = List[Dict[str, Any]]
# Rows whose dense reference differs in that way ("<config> <tag>" against "dense <tag>").
REFERENCE_TAGS = ("adam", "constant-LR", "cosine-in-loss", "4-epochs")
# The study's row groups, in table order.
GROUP_ORDER = ("grid", "baselines", "ablation", "adam", "schedule", "longer")


def _mean_std(xs: List[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarise(runs: Runs) -> List[Dict[str, Any]]:
    """One row per (dataset, config), in first-seen order, with seed means and stds."""
    groups: "OrderedDict[tuple, Runs]" = OrderedDict()  # (dataset, config, net)
    rank = {g: i for i, g in enumerate(GROUP_ORDER)}
    # Datasets in first-seen order; within one, the study's groups in order, then first seen.
    first = {ds: i for i, ds in reversed(list(enumerate(r["dataset"] for r in runs)))}
    for r in sorted(runs, key=lambda r: (first[r["dataset"]], rank.get(r.get("group"), 99))):
        groups.setdefault((r["dataset"], r["config"], net_of(r)), []).append(r)
    rows = []
    for (ds, config, net), all_rs in groups.items():
        rs = [r for r in all_rs if not r.get("diverged")]  # diverged runs are counted apart
        label = config if net == "loopback" else f"{config} @{net}"
        if not rs:
            rows.append({"dataset": ds, "config": config, "net": net, "label": label,
                         "method": all_rs[0]["method"],
                         "density": all_rs[0].get("density", 1.0), "seeds": 0,
                         "diverged": len(all_rs), "epochs": all_rs[0]["epochs"], "acc": None})
            continue
        last = [r["records"][-1] for r in rs]
        acc, acc_sd = _mean_std([x["test_accuracy"] for x in last])
        flushed, flushed_sd = _mean_std([x["flushed_accuracy"] for x in last])
        steps = [max(x["steps"], 1) for x in last]
        rows.append({
            "dataset": ds, "config": config, "net": net, "label": label,
            "group": rs[0].get("group", ""),
            "method": rs[0]["method"], "density": rs[0].get("density", 1.0), "seeds": len(rs),
            "diverged": len(all_rs) - len(rs),
            "acc": acc, "acc_sd": acc_sd, "flushed": flushed, "flushed_sd": flushed_sd,
            "pushed": statistics.fmean(x["bytes_pushed"] / s for x, s in zip(last, steps)),
            "pulled": statistics.fmean(x["bytes_pulled"] / s for x, s in zip(last, steps)),
            "dense": statistics.fmean(x["dense_bytes"] / s for x, s in zip(last, steps)),
            "seconds": statistics.fmean(r["seconds"] for r in rs),
            "by_seed": {r["seed"]: (x["test_accuracy"], x["flushed_accuracy"])
                        for r, x in zip(rs, last)},
            "epochs": rs[0]["epochs"]})
    for row in rows:  # the gap to dense on the same dataset; "<config> <tag>" to "dense <tag>"
        if row["acc"] is None:
            row["gap"] = row["flushed_gap"] = None
            continue
        ref_name = next((f"dense {t}" for t in REFERENCE_TAGS if row["config"].endswith(t)),
                        "dense")
        ref = next((x for x in rows if x["dataset"] == row["dataset"]
                    and x["config"] == ref_name and x["net"] == row["net"]), None)
        ref = ref if ref is not None and ref["acc"] is not None else None
        row["gap"], row["flushed_gap"] = (None, None) if ref is None else paired_gaps(row, ref)
    return rows


def paired_gaps(row: Dict[str, Any], ref: Dict[str, Any]) -> Tuple[float, float]:
    """``row``'s accuracy and flushed accuracy less ``ref``'s over the same seeds (dense run
    on more seeds than a peer would otherwise lend it their spread); over all of ``ref``'s when
    they share none."""
    common = [s for s in row["by_seed"] if s in ref["by_seed"]]
    if not common:
        return row["acc"] - ref["acc"], row["flushed"] - ref["flushed"]
    mean = lambda i, by: statistics.fmean(by[s][i] for s in common)  # noqa: E731
    return (mean(0, row["by_seed"]) - mean(0, ref["by_seed"]),
            mean(1, row["by_seed"]) - mean(1, ref["by_seed"]))


def _verdict(row: Dict[str, Any], target_gap: Dict[float, float]) -> str:
    target = target_gap.get(row["density"]) if row["method"] == "slim" else None
    if target is None or row["gap"] is None:
        return ""
    short = round(-row["gap"], 2) - target  # judged on the gap as the table shows it
    return "met" if short <= 1e-9 else f"missed by {short:.2f}"


def table(rows: List[Dict[str, Any]], target_gap: Dict[float, float]) -> str:
    """The markdown table: one block per dataset."""
    out = []
    for ds in OrderedDict.fromkeys(r["dataset"] for r in rows):
        sub = [r for r in rows if r["dataset"] == ds]
        out.append(f"\n**{ds}**: {sub[0]['epochs']} epochs, 4 ranks; accuracy = final test "
                   f"accuracy (%), mean ± std over seeds; Δ = vs dense on the same seeds; "
                   f"bytes per optimizer step, rank 0\n")
        out.append("| config | seeds | accuracy | Δ | after flush | Δ after flush | target "
                   "| pushed B/step | pulled B/step | dense/pushed | s/run |")
        out.append("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
        for r in sub:
            if r["acc"] is None:
                out.append(f"| {r['label']} | 0 (+{r['diverged']} diverged) | diverged | | | | "
                           f"| | | | |")
                continue
            gap = "" if r["gap"] is None else f"{r['gap']:+.2f}"
            fgap = "" if r["flushed_gap"] is None else f"{r['flushed_gap']:+.2f}"
            ratio = r["dense"] / r["pushed"] if r["pushed"] else float("inf")
            seeds = f"{r['seeds']}" + (f" (+{r['diverged']} diverged)" if r["diverged"] else "")
            out.append(f"| {r['label']} | {seeds} | {r['acc']:.2f} ± {r['acc_sd']:.2f} "
                       f"| {gap} | {r['flushed']:.2f} ± {r['flushed_sd']:.2f} | {fgap} "
                       f"| {_verdict(r, target_gap)} | {r['pushed']:,.0f} | {r['pulled']:,.0f} "
                       f"| {ratio:.1f}x | {r['seconds']:.0f} |")
    return "\n".join(out).lstrip("\n") + "\n"


def net_of(run: Dict[str, Any]) -> str:
    """The network a run ran on (runs from before ``--net`` ran on the plain loopback)."""
    return run.get("net") or "loopback"


def _curves(runs: Runs, x_key: Optional[str]) -> tuple[List[float], List[float], List[float]]:
    """Mean x, mean and std of accuracy per evaluation point over the seeds of one config."""
    points = [_points(r) for r in runs]
    xs, ms, sds = [], [], []
    for e in range(min(len(p) for p in points)):
        m, sd = _mean_std([p[e]["test_accuracy"] for p in points])
        x = statistics.fmean(p[e]["epoch"] if x_key is None else
                             (p[e]["bytes_pushed"] + p[e]["bytes_pulled"]) / 1e6 for p in points)
        xs.append(x), ms.append(m), sds.append(sd)
    return xs, ms, sds


def plot(runs: Runs, out: str) -> List[str]:
    """Accuracy vs epoch and vs bytes, per dataset: one panel per density, dense in each."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display on a server
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullFormatter
    except ImportError:
        return []
    written = []
    for ds in OrderedDict.fromkeys(r["dataset"] for r in runs):
        mine = [r for r in runs if r["dataset"] == ds and r.get("group") in ("grid", "baselines")
                and not r.get("diverged")]
        if not mine:
            continue
        by_config: "OrderedDict[str, Runs]" = OrderedDict()
        for r in mine:
            by_config.setdefault(r["config"], []).append(r)
        densities = sorted({r["density"] for r in mine if r["density"] < 1}, reverse=True)
        for x_key, suffix, xlabel in ((None, "epoch", "epoch"),
                                      ("bytes", "bytes", "MB pushed + pulled by rank 0")):
            panels = max(len(densities), 1)
            fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
            for ax, d in zip(axes[0], densities or [1.0]):
                for config, rs in by_config.items():
                    if rs[0]["density"] not in (1.0, d):
                        continue
                    xs, ms, sds = _curves(rs, x_key)
                    style = {"color": "black", "linewidth": 2} if rs[0]["method"] == "dense" \
                        else {"linestyle": "--"} if rs[0]["method"] == "topk" else {}
                    line, = ax.plot(xs, ms, marker="o", markersize=3, label=config, **style)
                    ax.fill_between(xs, [m - s for m, s in zip(ms, sds)],
                                    [m + s for m, s in zip(ms, sds)], alpha=0.12,
                                    color=line.get_color())
                if x_key is not None:  # dense sits decades to the right of the sparse runs
                    ax.set_xscale("log")
                    ax.xaxis.set_minor_formatter(NullFormatter())
                tta.label_accuracy_axes(ax, f"{ds}, density {d:g} (mean ± std over seeds)",
                                        xlabel)
            written.append(tta.save_figure(fig, os.path.join(out,
                                                             f"{ds}_accuracy_vs_{suffix}.png")))
    return written


def write_report(runs: Runs, out: str, target_gap: Dict[float, float],
                 tta_target: Optional[Dict[str, float]] = None) -> str:
    """Write table.md (with the time-to-accuracy tables for ``tta_target``) and the plots into
    ``out``; return the table."""
    text = table(summarise(runs), target_gap)
    if tta_target:
        text += tta.tables(runs, tta_target)
    with open(os.path.join(out, "table.md"), "w", encoding="utf-8") as f:
        f.write(text)
    for path in plot(runs, out) + tta.plot(runs, tta_target or {}, out):
        text += f"\nwrote {path}"
    return text
