"""The cluster study's summary (benchmarks/cluster_study.py): one Markdown file of every series'
table, each with the command and load it was measured under, and the scaling plots."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from .report import _fmt_b


def _ok(res: Dict[str, Any], peer: str) -> Optional[Dict[str, Any]]:
    p = res["peers"].get(peer)
    return p if p and p["status"] == "ok" else None


def _provenance(res: Dict[str, Any]) -> str:
    load = f"load {res['loadavg_start'][0]:.2f} at start, {res['loadavg_end'][0]:.2f} at end"
    pp = res.get("network", {}).get("pingpong")
    link = f"; link measured {pp['gbit_per_s']:.2f} Gbit/s" if pp else ""
    return f"`{res['command'].split(' -m ', 1)[-1]}` ({load}{link}; {res['started']})"


def _peer_table(res: Dict[str, Any]) -> List[str]:
    floor = _ok(res, "floor")
    lines = ["| peer | s/step | x compute | x dense | busiest NIC out / in per step |",
             "|---|---:|---:|---:|---:|"]
    for name in res["peers"]:
        p = _ok(res, name)
        if p is None:
            lines.append(f"| {name} | {res['peers'][name]['status']} | | | |")
            continue
        nic = p.get("nic_bytes_per_step")
        x_compute = f"{p['median_s'] / floor['median_s']:.2f}" if floor else "-"
        x_dense = f"{p['time_vs_dense']:.2f}" if p.get("time_vs_dense") else "-"
        nic_s = f"{_fmt_b(nic['busiest_tx'])} / {_fmt_b(nic['busiest_rx'])}" if nic else "-"
        lines.append(f"| {name} | {p['median_s']:.3f} | {x_compute} | {x_dense} | {nic_s} |")
    return lines


def _scaling(results: Dict[str, Dict[str, Any]], out: str) -> List[str]:
    runs = sorted((r["study"]["hosts"], r) for r in results.values()
                  if r["study"]["series"] == "scaling")
    if not runs:
        return []
    peers = list(runs[0][1]["peers"])
    ns = [n for n, _ in runs]
    lines = ["## Scaling: 2, 4, 8 hosts at 100 Mbit/s, 1.1M parameters", "",
             "s/step, and the busiest NIC's bytes received per step (counted):", "",
             "| peer | " + " | ".join(f"N={n} s/step | N={n} busiest in" for n in ns) + " |",
             "|---|" + "---:|---:|" * len(ns)]
    series: Dict[str, List[Any]] = {}
    for peer in peers:
        row = [peer]
        for _, res in runs:
            p = _ok(res, peer)
            nic = (p or {}).get("nic_bytes_per_step")
            row += [f"{p['median_s']:.3f}" if p else "-",
                    _fmt_b(nic["busiest_rx"]) if nic else "-"]
            series.setdefault(peer, []).append(
                (p["median_s"] if p else None, nic["busiest_rx"] if nic else None))
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Balance: the busiest NIC's bytes (out + in) per step over the mean NIC's:", "",
              "| peer | " + " | ".join(f"N={n}" for n in ns) + " |",
              "|---|" + "---:|" * len(ns)]
    for peer in peers:
        cells = []
        for _, res in runs:
            hosts = ((_ok(res, peer) or {}).get("nic_bytes_per_step") or {}).get("per_host")
            moved = [h["tx"] + h["rx"] for h in hosts or []]
            cells.append(f"{max(moved) / (sum(moved) / len(moved)):.2f}x" if moved and sum(moved)
                         else "-")
        lines.append(f"| {peer} | " + " | ".join(cells) + " |")
    lines += ["", *[f"- N={n}: {_provenance(r)}" for n, r in runs], ""]
    lines += _scaling_plots(ns, series, out)
    return lines


def _scaling_plots(ns: List[int], series: Dict[str, List[Any]], out: str) -> List[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["(matplotlib missing: no plots)"]
    written = []
    for idx, (what, fname) in enumerate((("s per step", "scaling_step_time.png"),
                                         ("busiest NIC bytes in per step",
                                          "scaling_busiest_nic.png"))):
        fig, ax = plt.subplots(figsize=(6, 4))
        for peer, pts in series.items():
            xs = [n for n, pt in zip(ns, pts) if pt[idx] is not None]
            ys = [pt[idx] for pt in pts if pt[idx] is not None]
            if xs and (idx == 0 or peer != "floor"):
                ax.plot(xs, ys, marker="o", label=peer)
        ax.set_xlabel("hosts (one NIC each, 100 Mbit/s)")
        ax.set_ylabel(what)
        ax.set_xticks(ns)
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out, fname), dpi=110)
        plt.close(fig)
        written.append(f"![{what}]({fname})")
    return written + [""]


def _hetero(results: Dict[str, Dict[str, Any]]) -> List[str]:
    base = results.get("peers_resnet18_4h_1g")
    runs = sorted((r["study"]["slow"], r) for r in results.values()
                  if r["study"]["series"] == "hetero")
    if not runs or base is None:
        return []
    lines = ["## Heterogeneity: 4 hosts at 1 Gbit/s, one at 250 Mbit/s (ResNet-18 shapes)", "",
             "| peer | all at 1 Gbit/s | " + " | ".join(
                 f"host {s} slow ({'the server' if s == 0 else 'a worker'})" for s, _ in runs)
             + " |", "|---|---:|" + "---:|" * len(runs)]
    for peer in runs[0][1]["peers"]:
        b = _ok(base, peer)
        cells = []
        for _, res in runs:
            p = _ok(res, peer)
            cells.append("-" if not p else f"{p['median_s']:.3f}" + (
                f" ({p['median_s'] / b['median_s']:.2f}x)" if b else ""))
        lines.append(f"| {peer} | {b['median_s']:.3f} | " if b else f"| {peer} | - | ")
        lines[-1] += " | ".join(cells) + " |"
    return lines + ["", *[f"- host {s} slow: {_provenance(r)}" for s, r in runs], ""]


def summarise(results: Dict[str, Dict[str, Any]], out: str) -> str:
    """Write ``out/summary.md`` (and the scaling plots) from the study's results; its text."""
    lines = ["# The cluster benchmark (benchmarks/cluster_study.py)", "",
             "Every host is a network namespace with one NIC into a switch (benchmarks/"
             "cluster.py); rates are per NIC and per direction. Figures are medians of the "
             "measured steps; each table names its command and the machine's load.", ""]
    peers = results.get("peers_resnet18_4h_1g")
    if peers:
        lines += ["## Every peer: ResNet-18 shapes, 4 hosts at 1 Gbit/s", "",
                  _provenance(peers), "", *_peer_table(peers),
                  "", "Full table: [peers_resnet18_4h_1g.md](peers_resnet18_4h_1g.md)", ""]
    for tag, res in results.items():
        if res["study"]["series"] == "compute":
            lines += [f"## End to end with compute: {res['settings']['model']}, 4 hosts at "
                      f"1 Gbit/s", "", _provenance(res), "", *_peer_table(res), ""]
    for tag, res in results.items():
        if res["study"]["series"] == "overlap":
            lines += [f"## Overlap with backward: {res['settings']['model']}, 4 hosts at "
                      f"1 Gbit/s", "", _provenance(res), "", *_peer_table(res), ""]
    lines += _scaling(results, out)
    lines += _hetero(results)
    shared = results.get("shared_resnet18_4r_1g")
    if shared:
        lines += ["## For comparison: the shared medium (all 4 ranks on one 1 Gbit/s link)", "",
                  _provenance(shared), "", *_peer_table(shared), ""]
    text = "\n".join(lines) + "\n"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "summary.md"), "w", encoding="utf-8") as f:
        f.write(text)
    return text
