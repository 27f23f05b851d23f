"""PNG plots of a benchmark result: step time and bytes per peer, step time against density."""
from __future__ import annotations

import os
from typing import Any, Dict, List

COLORS = {"floor": "#888888", "mpi": "#1f77b4", "horovod": "#9467bd", "ddp": "#ff7f0e",
          "topk": "#d62728", "hvd_slim": "#2ca02c"}


def _family(name: str) -> str:
    for key in ("floor", "horovod", "ddp", "topk", "hvd_slim"):
        if name.startswith(key):
            return key
    return "mpi"


def _title(res: Dict[str, Any]) -> str:
    s = res["settings"]
    return f"{s['model']}, {s['ranks']} ranks, {s['net']}"


def draw(res: Dict[str, Any], out_dir: str, tag: str) -> List[str]:
    """Write the three plots; returns their paths (none when matplotlib is missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    ok = {n: p for n, p in res["peers"].items() if p["status"] == "ok"}
    if not ok:
        return []
    paths = []
    names = list(ok)
    colors = [COLORS[_family(n)] for n in names]

    fig, ax = plt.subplots(figsize=(8, 0.35 * len(names) + 1.5))
    med = [ok[n]["median_s"] for n in names]
    err = [[m - ok[n]["p10_s"] for n, m in zip(names, med)],
           [ok[n]["p90_s"] - m for n, m in zip(names, med)]]
    ax.barh(names, med, xerr=err, color=colors, capsize=2)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("median step time, s (bars: p10-p90)")
    ax.set_title(f"Step time per peer ({_title(res)})")
    paths.append(_save(fig, out_dir, f"{tag}_step_time.png"))

    have = [n for n in names if ok[n]["bytes_sent_per_step"] > 0]
    if have:
        fig, ax = plt.subplots(figsize=(8, 0.35 * len(have) + 1.5))
        sent = [ok[n]["bytes_sent_per_step"] for n in have]
        bars = ax.barh(have, sent, color=[COLORS[_family(n)] for n in have])
        for b, n in zip(bars, have):
            if ok[n]["basis"].get("wire") != "counted":
                b.set_hatch("//")
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_xlabel("bytes sent per rank per step (hatched: derived, plain: counted)")
        ax.set_title(f"Traffic per peer ({_title(res)})")
        paths.append(_save(fig, out_dir, f"{tag}_bytes.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for prefix, style in (("hvd_slim-slim@", "o-"), ("hvd_slim-union@", "s-"), ("topk-ef@", "^--")):
        pts = sorted((float(n.split("@")[1]), p["median_s"]) for n, p in ok.items()
                     if n.startswith(prefix))
        if pts:
            ax.plot([d for d, _ in pts], [t for _, t in pts], style,
                    color=COLORS[_family(prefix)] if prefix != "hvd_slim-union@" else "#17becf",
                    label=prefix.rstrip("@"))
    for n, ls in (("mpi-allreduce", "-"), ("ddp-fp16", "--"), ("ddp-powersgd-r1", ":"),
                  ("ddp-powersgd-r4", "-."), ("horovod-fp16", (0, (1, 3))), ("floor", "-")):
        if n in ok:
            ax.axhline(ok[n]["median_s"], color=COLORS[_family(n)], ls=ls, lw=1, label=n)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("density (k/d)")
    ax.set_ylabel("median step time, s")
    ax.set_title(f"Step time against density ({_title(res)})")
    ax.legend(fontsize=7, loc="best")
    paths.append(_save(fig, out_dir, f"{tag}_density.png"))
    return paths


def _save(fig: Any, out_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
