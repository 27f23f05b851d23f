"""Time to accuracy from sweep results (sweep.py's JSON lines): tables and a plot.

A run's evaluation points (``points``) carry ``wall_seconds``: rank 0's training wall-clock time
since the start of the run, every evaluation excluded (``training.fit``); the evaluations' own
time is ``eval_seconds``, reported apart. ``reached(run, target)`` is the first point at or
above ``target`` % test accuracy; ``tables`` summarises it per dataset, network and config.
Runs recorded before the points were timed are left out (``timed``).
"""
from __future__ import annotations

import os
import statistics
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

Run = Dict[str, Any]
MODELLED = ("horovod", "topk")  # methods whose bytes are modelled, not counted by a transport


def points(run: Run) -> List[Dict[str, Any]]:
    """A run's evaluation points in order: intermediate ones (``curve``), then each epoch's."""
    return [p for rec in run["records"] for p in rec.get("curve", []) + [rec]]


def timed(run: Run) -> bool:
    """Whether every evaluation point of the run has its training time (and it did not diverge)."""
    return (not run.get("diverged") and bool(run.get("records"))
            and all("wall_seconds" in p for p in points(run)))


def reached(run: Run, target: float) -> Optional[Dict[str, float]]:
    """The first evaluation at or above ``target`` %: ``seconds`` (training only), ``epoch``
    (fractional), ``steps``, ``eval_seconds`` (spent evaluating until then) and rank 0's
    cumulative ``bytes_pushed``/``bytes_pulled``; None if the run never got there."""
    for p in points(run):
        if p["test_accuracy"] >= target - 1e-9:
            return {"seconds": float(p["wall_seconds"]), "epoch": float(p["epoch"]),
                    "steps": float(p["steps"]), "eval_seconds": float(p.get("eval_seconds", 0.0)),
                    "bytes_pushed": float(p["bytes_pushed"]),
                    "bytes_pulled": float(p["bytes_pulled"])}
    return None


def _mean_std(xs: List[float]) -> Tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarise(runs: List[Run], targets: Dict[str, float]) -> List[Dict[str, Any]]:
    """One row per (dataset, network, config) of the timed runs of a dataset in ``targets``,
    in first-seen order: seeds, seeds that reached the target, and means and stds over those."""
    groups: "OrderedDict[tuple, List[Run]]" = OrderedDict()
    for r in runs:
        if r["dataset"] in targets and timed(r):
            groups.setdefault((r["dataset"], r.get("net") or "loopback", r["config"]), []).append(r)
    rows = []
    for (ds, net, config), rs in groups.items():
        target = targets[ds]
        hits = [h for h in (reached(r, target) for r in rs) if h is not None]
        row: Dict[str, Any] = {
            "dataset": ds, "net": net, "config": config, "method": rs[0]["method"],
            "target": target, "seeds": len(rs), "reached": len(hits),
            "train_seconds": statistics.fmean(r["records"][-1]["wall_seconds"] for r in rs),
            "final": statistics.fmean(r["records"][-1]["test_accuracy"] for r in rs),
            "epochs_run": rs[0]["epochs"],
            "load": [r["loadavg"][0] for r in rs if r.get("loadavg")],
            "gbit_per_s": [r["network"]["pingpong"]["gbit_per_s"] for r in rs
                           if "pingpong" in r.get("network", {})]}
        if hits:
            for key in ("seconds", "epoch", "eval_seconds", "bytes_pushed", "bytes_pulled"):
                row[key], row[key + "_sd"] = _mean_std([h[key] for h in hits])
        rows.append(row)
    for row in rows:  # speed-up against dense on the same dataset and network
        ref = next((x for x in rows if x["method"] == "dense" and x["dataset"] == row["dataset"]
                    and x["net"] == row["net"] and "seconds" in x), None)
        row["vs_dense"] = (ref["seconds"] / row["seconds"]
                           if ref is not None and "seconds" in row else None)
    return rows


def table(rows: List[Dict[str, Any]]) -> str:
    """Markdown: one "time to <target>% on <net>" table per (dataset, network)."""
    out = []
    for ds, net in OrderedDict.fromkeys((r["dataset"], r["net"]) for r in rows):
        sub = [r for r in rows if r["dataset"] == ds and r["net"] == net]
        target, rates = sub[0]["target"], [g for r in sub for g in r["gbit_per_s"]]
        span = (f"{min(rates):.2f}" if f"{min(rates):.2f}" == f"{max(rates):.2f}"
                else f"{min(rates):.2f}-{max(rates):.2f}") if rates else ""
        link = f"; link measured {span} Gbit/s by a 16 MiB MPI ping-pong" if rates else ""
        out.append(f"\n**Time to {target:g}% on {net}** ({ds}, {sub[0]['epochs_run']}-epoch "
                   f"runs{link}). Seconds: rank 0's training wall-clock time until the first "
                   f"evaluation at or above {target:g}%, evaluations excluded (their time is "
                   f"the \"eval s\" column); mean ± std over the seeds that reached it. MB: rank "
                   f"0's cumulative pushed (sent) and pulled bytes until then. Load: the "
                   f"machine's 1-minute load average at the start of the runs (mean).\n")
        out.append(f"| config | reached | seconds to {target:g}% | x dense | epochs to "
                   f"{target:g}% | pushed MB | pulled MB | eval s | training s, all epochs "
                   f"| final accuracy | load |")
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in sub:
            star = " *" if r["method"] in MODELLED else ""
            head = f"| {r['config']} | {r['reached']}/{r['seeds']} |"
            load = f"{statistics.fmean(r['load']):.1f}" if r["load"] else ""
            tail = f" {r['train_seconds']:.0f} | {r['final']:.2f} | {load} |"
            if "seconds" not in r:
                out.append(head + " not reached | | | | | |" + tail)
                continue
            ratio = "" if r["vs_dense"] is None else f"{r['vs_dense']:.2f}x"
            out.append(head + f" {r['seconds']:.0f} ± {r['seconds_sd']:.0f} | {ratio} "
                       f"| {r['epoch']:.2f} ± {r['epoch_sd']:.2f} "
                       f"| {r['bytes_pushed'] / 1e6:,.1f}{star} "
                       f"| {r['bytes_pulled'] / 1e6:,.1f}{star} "
                       f"| {r['eval_seconds']:.0f} |" + tail)
        if any(r["method"] in MODELLED for r in sub):
            out.append("\n\\* modelled from the gradient shapes (a ring allreduce), not counted.")
    return "\n".join(out) + ("\n" if out else "")


def tables(runs: List[Run], targets: Dict[str, float]) -> str:
    """``table(summarise(runs, targets))``."""
    return table(summarise(runs, targets))


def plot(runs: List[Run], targets: Dict[str, float], out: str) -> List[str]:
    """Test accuracy against training seconds, per (dataset, network) of timed runs, with the
    target as a line: ``<dataset>_accuracy_vs_seconds_<net>.png``."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    mine = [r for r in runs if r["dataset"] in targets and timed(r)]
    written = []
    for ds, net in OrderedDict.fromkeys((r["dataset"], r.get("net") or "loopback") for r in mine):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        colours: Dict[str, Any] = {}
        for r in (r for r in mine if r["dataset"] == ds and (r.get("net") or "loopback") == net):
            pts = points(r)
            line, = ax.plot([p["wall_seconds"] for p in pts], [p["test_accuracy"] for p in pts],
                            marker="o", markersize=3, color=colours.get(r["config"]),
                            label=None if r["config"] in colours else r["config"], alpha=0.8)
            colours[r["config"]] = line.get_color()
        ax.axhline(targets[ds], color="grey", linestyle=":", label=f"{targets[ds]:g}%")
        ax.set_ylim(max(90.0, targets[ds] - 6), 100)
        label_accuracy_axes(ax, f"{ds} on {net}: every seed",
                            "rank 0's training seconds (evaluations excluded)")
        written.append(save_figure(fig, os.path.join(out, f"{ds}_accuracy_vs_seconds_{net}.png")))
    return written


def label_accuracy_axes(ax: Any, title: str, xlabel: str) -> None:
    """Title, axis labels, grid and legend of a test-accuracy panel (report.py's too)."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def save_figure(fig: Any, path: str) -> str:
    """Write ``fig`` to ``path`` as the study's PNGs are written, close it; returns ``path``."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
