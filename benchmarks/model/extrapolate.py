"""The model far beyond the benchmark: N = 16 .. 1024 hosts on a switched network of 10 and
100 Gbit/s NICs, for ResNet-50 (25.6M parameters) and a 1.28B-parameter transformer.

Defaults: one rank per host, 5 us one-way latency, no per-message overhead, no token buckets, an
ideal full-duplex MPI (``--mpi openmpi-tcp`` for Open MPI over TCP as the benchmark runs it),
no compute and no local work, so the figures are each strategy's communication time per step
(``--compute-s`` and the ``--*-ns`` costs add the rest). Sharded servers pull in one
``Iallgatherv``: n - 1 messages a rank, so ``--overhead-us`` adds (n - 1) times its cost.
Writes ``extrapolation.md`` and one PNG per model (when matplotlib is there) into ``--out``.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

from . import net as nw
from .slim import SlimSettings
from .strategies import LocalCosts, Prediction, Scenario, predict
from .workloads import numel, shapes_of

DEFAULT_PEERS = ("mpi-allreduce", "horovod-fp16", "ddp-powersgd-r4", "topk-ef@0.01",
                 "hvd_slim-slim@0.02", "hvd_slim-slim@0.01", "hvd_slim-union@0.01",
                 "hvd_slim-sharded@0.01")
DEFAULT_RANKS = (16, 32, 64, 128, 256, 512, 1024)
DEFAULT_RATES = (10.0, 100.0)
DEFAULT_MODELS = ("resnet50", "transformer-1b")
LATENCY_S = 5e-6

Grid = Dict[Tuple[str, float], Dict[int, Dict[str, Prediction]]]


def grid(models: Sequence[str], rates: Sequence[float], ranks: Sequence[int],
         peers: Sequence[str], latency_s: float = LATENCY_S, overhead_s: float = 0.0,
         compute_s: float = 0.0, local: LocalCosts = LocalCosts(),
         slim: SlimSettings = SlimSettings(), allreduce: str = "ring", mpi: str = "ideal",
         slow_host: Optional[float] = None) -> Grid:
    """Every peer's prediction for every (model, rate in Gbit/s) and rank count. ``slow_host``:
    the last host's NIC at that fraction of the rate (the server, rank 0, keeps the full one)."""
    out: Grid = {}
    for model in models:
        shapes = tuple(shapes_of(model))
        for rate in rates:
            per_n: Dict[int, Dict[str, Prediction]] = {}
            for n in ranks:
                rates_bps = [rate * 1e9] * n
                if slow_host is not None:
                    rates_bps[-1] *= slow_host
                net = nw.Network("switched", tuple(rates_bps), latency_s=latency_s,
                                 overhead_s=overhead_s)
                sc = Scenario(n, net, shapes, compute_s=compute_s, local=local, slim=slim,
                              allreduce=allreduce, mpi=mpi)
                per_n[n] = {p: predict(p, sc) for p in peers}
            out[(model, rate)] = per_n
    return out


def _first_loss(per_n: Dict[int, Dict[str, Prediction]], peer: str, rival: str) -> str:
    """The smallest N at which ``peer`` is slower than ``rival`` (or never / always)."""
    ns = sorted(per_n)
    lose = [n for n in ns if per_n[n][peer].seconds > per_n[n][rival].seconds]
    if not lose:
        return f"never up to {ns[-1]}"
    if lose[0] == ns[0]:
        return f"already at {ns[0]}"
    return f"from N = {lose[0]}"


def headline(g: Grid, peers: Sequence[str],
             baselines: Sequence[str] = ("mpi-allreduce", "horovod-fp16")) -> List[str]:
    """Who is fastest where, and where each hvd_slim peer loses to the dense allreduces."""
    lines = []
    for (model, rate), per_n in g.items():
        wins: List[Tuple[str, List[int]]] = []
        for n in sorted(per_n):
            best = min(peers, key=lambda p: per_n[n][p].seconds)
            if wins and wins[-1][0] == best:
                wins[-1][1].append(n)
            else:
                wins.append((best, [n]))
        span = "; ".join(f"{p} (N {ns[0]}-{ns[-1]})" if len(ns) > 1 else f"{p} (N {ns[0]})"
                         for p, ns in wins)
        lines.append(f"- {model} at {rate:g} Gbit/s: fastest {span}.")
        for p in peers:
            if p.startswith("hvd_slim"):
                losses = [f"{b} {_first_loss(per_n, p, b)}" for b in baselines if b in peers]
                if losses:
                    lines.append(f"  - {p} slower than " + "; than ".join(losses))
    return lines


def markdown(g: Grid, peers: Sequence[str], title: str) -> str:
    out = [f"## {title}", ""]
    for (model, rate), per_n in g.items():
        d = numel(shapes_of(model))
        out += [f"### {model} (d = {d / 1e6:.1f}M), {rate:g} Gbit/s per host", "",
                "| N | " + " | ".join(peers) + " | fastest |", "|---:|" + "---:|" * len(peers) +
                "---|"]
        for n, preds in sorted(per_n.items()):
            best = min(peers, key=lambda p: preds[p].seconds)
            out.append(f"| {n} | " + " | ".join(f"{preds[p].seconds:.4g}" for p in peers) +
                       f" | {best} |")
        out += ["", "Busiest NIC, MB received per step (largest N): " + ", ".join(
            f"{p} {per_n[max(per_n)][p].busiest_rx / 1e6:.1f}" for p in peers), ""]
    return "\n".join(out)


def plot(g: Grid, peers: Sequence[str], out_dir: str, ylabel: str) -> List[str]:
    """One PNG per model (a panel per rate); [] when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    models = sorted({m for m, _ in g})
    for model in models:
        keys = [k for k in g if k[0] == model]
        fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4.5), squeeze=False)
        for ax, key in zip(axes[0], keys):
            per_n = g[key]
            ns = sorted(per_n)
            for p in peers:
                ax.plot(ns, [per_n[n][p].seconds for n in ns], marker="o", label=p)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("hosts N")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{model}, {key[1]:g} Gbit/s per host (switched)")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][-1].legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, f"extrapolate_{model}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(out_dir: str, models: Sequence[str], rates: Sequence[float], ranks: Sequence[int],
         peers: Sequence[str], **kw) -> int:
    """Write the table and plots; print the Markdown. Returns 0."""
    os.makedirs(out_dir, exist_ok=True)
    g = grid(models, rates, ranks, peers, **kw)
    comm_only = not kw.get("compute_s") and kw.get("local", LocalCosts()) == LocalCosts()
    what = "communication s/step" if comm_only else "s/step (compute + local + communication)"
    lat, loc = kw.get("latency_s", LATENCY_S), kw.get("local", LocalCosts())
    slim = kw.get("slim", SlimSettings())
    title = (f"Extrapolation: {what}, switched network, one rank per host, "
             f"{lat * 1e6:g} us latency, {kw.get('overhead_s', 0.0) * 1e6:g} us per message, "
             f"dense allreduce by {kw.get('allreduce', 'ring')} ({kw.get('mpi', 'ideal')} "
             f"MPI), hvd_slim at value_bits {slim.value_bits} with its pull by libnbc's Ibcast "
             f"(a binomial tree beyond 4 ranks), sharded pulls by one Iallgatherv")
    if not comm_only:
        title += (f"; compute {kw.get('compute_s', 0.0):g} s, per element: pass "
                  f"{loc.pass_s * 1e9:.3g} ns, top-k selection {loc.topk_select_s * 1e9:.3g} ns, "
                  f"hvd_slim selection {loc.slim_select_s * 1e9:.3g} ns")
    text = markdown(g, peers, title) + "\n## Where each wins\n\n" + \
        "\n".join(headline(g, peers)) + "\n"
    pngs = plot(g, peers, out_dir, what)
    text += "\n" + ("\n".join(f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in pngs)
                    if pngs else "(matplotlib not installed: no plots)") + "\n"
    with open(os.path.join(out_dir, "extrapolation.md"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    return 0
