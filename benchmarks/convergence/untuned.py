"""The untuned battery and the language model: hvd_slim's defaults on scripts nobody tuned.

Each battery case is a Horovod-style MNIST script as a user writes it (Horovod's own example
CNN, batch 64 per rank, 4 ranks, 3 epochs, its own optimizer settings), run three ways: dense
(``density=1.0``), hvd_slim with no keyword at all (the shipped defaults), and with
``HVD_SLIM_DENSITY=0.001``. The language model is a ~1.3M-parameter byte-level transformer on
the standard library's sources (lm.py), AdamW with a warm-up and cosine decay.
Peers for the accuracy-against-bytes plots: top-k with error feedback and PowerSGD (rank 1 and
4, torch DDP's hook), on the main battery case and on the language model.

``configs(group)`` gives the study's run configurations (study.py plans and
runs them); ``report(runs, out)`` writes ``untuned.md`` and the plots from the results.
"""
from __future__ import annotations

import os
import statistics
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

# (name, method, density, Slim-DP keywords, other spec fields): as convergence.Config
Config = Tuple[str, str, float, Dict[str, Any], Dict[str, Any]]

CNN = {"dataset": "mnist", "model": "horovod-cnn", "batch_size": 64, "epochs": 3,
       "lr": 0.04, "schedule": "constant", "evals_per_epoch": 1}
# The cases: what a user's script sets (lr 0.01 x 4 ranks, as Horovod's example scales it).
CASES: "OrderedDict[str, Dict[str, Any]]" = OrderedDict([
    ("sgd", {"momentum": 0.0}),
    ("sgd-m0.5", {"momentum": 0.5}),   # Horovod's pytorch_mnist.py as it ships
    ("nesterov-step", {"momentum": 0.9, "nesterov": True, "schedule": "step"}),
    ("adamw-warmup", {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.01,
                      "lr_warmup_steps": 100}),
    ("sgd-m0.5 1-epoch", {"momentum": 0.5, "epochs": 1}),
    ("sgd-m0.5 8-epochs", {"momentum": 0.5, "epochs": 8}),
])
PLOTTED = ("sgd-m0.5", "lm")   # the cases whose accuracy-against-bytes plot has the peers
LM = {"dataset": "pystdlib", "batch_size": 8, "epochs": 1, "train_subset": 19200,
      "optimizer": "adamw", "lr": 2e-3, "weight_decay": 0.1, "schedule": "cosine",
      "lr_warmup_steps": 100, "evals_per_epoch": 6}
TARGETS = {"end": {"default": 0.3, "0.001": 0.5}, "epoch 1": {"default": 1.0},
           "lm": {"default": 0.01, "0.001": 0.02}, "bytes": {"default": 40, "0.001": 150}}
VARIANTS = (("dense", "dense", 1.0, {}), ("default", "slim", None, {}),
            ("0.001", "slim", 0.001, {}))
PEERS = (("top-k 0.02", "topk", 0.02, {}), ("top-k 0.001", "topk", 0.001, {}),
         ("PowerSGD r1", "powersgd", 1.0, {"powersgd_rank": 1}),
         ("PowerSGD r4", "powersgd", 1.0, {"powersgd_rank": 4}))
DEFAULT_DENSITY = 0.02  # hvd_slim's; a "default" run passes no keyword, this is for the table
# Why the language model's gap: the defaults with one keyword changed (1 seed, not plotted).
LM_ABLATION = (("default adam_variance=live", {"adam_variance": "live"}),
               ("default value_bits=32", {"value_bits": 32}),
               ("default exploration=0", {"exploration": 0.0}),
               ("default pull=union", {"pull": "union"}))
# The same question on the battery's AdamW script (3 seeds): Adam's own step on the bursts.
ADAMW_ABLATION = (("default adam_variance=live", None, {"adam_variance": "live"}),
                  ("0.001 adam_variance=live", 0.001, {"adam_variance": "live"}))


# overlap=4 (exchange/overlap/staged.py) selects per stage, each with density of its own
# coordinates, instead of one global selection: the battery's plotted case and the language model,
# against the defaults run beside them (1 seed for the language model, 3 for MNIST).
OVERLAP_ABLATION = (("default", {}), ("default overlap=4", {"overlap": 4}))

# local_steps=H (outer/rounds.py): H local steps, then the pseudo-gradient through the exchange
# to DiLoCo's outer optimizer; traffic once per H steps.
LOCAL_ABLATION = (("default", None, {}), ("default local_steps=8", None, {"local_steps": 8}),
                  # the target point: H = 32, density 0.01, 4-bit values
                  ("local_steps=32 0.01 4-bit", 0.01, {"local_steps": 32, "value_bits": 4}),
                  # and with its exchange overlapped with the next round (outer/delayed.py)
                  ("local_steps=32 0.01 4-bit outer_delay=1", 0.01,
                   {"local_steps": 32, "value_bits": 4, "outer_delay": 1}),
                  # SparseLoCo's recipe: the decayed residual is the momentum, the outer step
                  # plain SGD at lr 1 (residual_decay, memory/residual.py)
                  ("local_steps=32 0.01 4-bit decay=0.95 outer=sgd", 0.01,
                   {"local_steps": 32, "value_bits": 4, "residual_decay": 0.95,
                    "outer_sgd": {"lr": 1.0}}))

# The local-steps grid (``--groups local-grid``, 1 seed a point): H x density x value bits,
# the target point left to LOCAL_ABLATION, and DiLoCo's own exchange (density 1.0, 32-bit) at
# H = 32, to tell what local steps cost from what the compression costs. The language model
# ran the points listed in docs/accuracy.md (``--only``), MNIST all of them.
GRID_H, GRID_DENSITY, GRID_BITS = (1, 8, 32, 128), (0.01, 0.001), (4, 32, 8, 2)
LOCAL_GRID = tuple(
    [(f"local_steps={h} {d} {b}-bit", d, {"local_steps": h, "value_bits": b})
     for b in GRID_BITS for d in GRID_DENSITY for h in GRID_H if (h, d, b) != (32, 0.01, 4)]
    + [("local_steps=32 dense", 1.0, {"local_steps": 32, "value_bits": 32})])

# Screening local_steps=8's defaults on the language model (``--groups local-defaults``, seed
# 0): what the rounds cost with DiLoCo's dense exchange, then SparseLoCo's recipe (decayed
# residual, outer SGD at lr 1) at 2-bit pushes with every tensor compressed (the small ones,
# 1% of the coordinates, are 2/3 of a 0.01-density round's bytes sent dense) and no warm-up:
# top-k at 0.01, and seeded random coordinates at 0.05 (their indices never travel, so 5x the
# coordinates for the same bytes), each with an 8-bit pull 4x the push.
_SPARSE_ROUNDS = {"local_steps": 8, "value_bits": 2, "pull_value_bits": 8,
                  "residual_decay": 0.95, "outer_sgd": {"lr": 1.0}, "min_compress_numel": 0,
                  "warmup_decay_steps": 0}
LOCAL_SCREEN = (
    ("local_steps=8 dense", 1.0, {"local_steps": 8, "value_bits": 32}),
    ("local_steps=8 sparseloco top-k 0.01", 0.01, dict(_SPARSE_ROUNDS, pull_density=0.04)),
    ("local_steps=8 sparseloco random 0.05", 0.05,
     dict(_SPARSE_ROUNDS, pull_density=0.2, exploration=1.0)),
    ("local_steps=8 sparseloco top-k 0.05", 0.05, dict(_SPARSE_ROUNDS, pull_density=0.2)),
    # then, around the 0.01 top-k point: DiLoCo's rounds with plain averaging (outer SGD at lr
    # 1), no decay, DiLoCo's outer Nesterov instead of lr 1, the automatic warm-up on
    ("local_steps=8 dense outer=sgd", 1.0,
     {"local_steps": 8, "value_bits": 32, "outer_sgd": {"lr": 1.0}}),
    ("local_steps=8 sparseloco top-k 0.01 no decay", 0.01,
     dict(_SPARSE_ROUNDS, pull_density=0.04, residual_decay=1.0)),
    ("local_steps=8 sparseloco top-k 0.01 outer=nesterov", 0.01,
     dict(_SPARSE_ROUNDS, pull_density=0.04,
          outer_sgd={"lr": 0.7, "momentum": 0.9, "nesterov": True})),
    # (warmup_decay_steps None passed: automatic; left out, the local defaults turn it off,
    # which the first run of this point did, its record relabelled "void")
    ("local_steps=8 sparseloco top-k 0.01 warm-up on", 0.01,
     dict(_SPARSE_ROUNDS, pull_density=0.04, warmup_decay_steps=None)))

# The warm-up ending on a signal (``--groups warmup-settle``; exchange/warmup.py) against the
# warm-up by count, which the defaults' runs above had: the language model, the battery's plotted
# case and its AdamW script, and local steps at H = 8 given a warm-up (the local defaults have
# none, as the warm-up by count spanned most of a short run).
SETTLE = 0.5
SETTLE_SCREEN = (("lm", "default warmup_settle=0.5", None, {"warmup_settle": SETTLE}),
                 ("sgd-m0.5", "default warmup_settle=0.5", None, {"warmup_settle": SETTLE}),
                 ("adamw-warmup", "default warmup_settle=0.5", None,
                  {"warmup_settle": SETTLE}),
                 ("lm", "local_steps=8 warm-up settle=0.5", None,
                  {"local_steps": 8, "warmup_decay_steps": None, "warmup_settle": SETTLE}))

# Averaging a sliced coordinate over the ranks that sent it (``--groups sparse-average``;
# exchange/server.py, sparse_average="senders") against the mean over every rank: local steps
# at their defaults, where a coordinate is sent about once every 100 rounds, and the per-step
# defaults on the language model and the battery's plotted case.
SENDERS_SCREEN = (("lm", "local_steps=8 sparse_average=senders", None,
                   {"local_steps": 8, "sparse_average": "senders"}),
                  ("lm", "default sparse_average=senders", None, {"sparse_average": "senders"}),
                  ("sgd-m0.5", "default sparse_average=senders", None,
                   {"sparse_average": "senders"}),
                  # and, with local steps, what else might close their last points: an outer
                  # step past lr 1, the warm-up ending on a signal
                  ("lm", "local_steps=8 sparse_average=senders outer lr 1.5", None,
                   {"local_steps": 8, "sparse_average": "senders", "outer_sgd": {"lr": 1.5}}),
                  ("lm", "local_steps=8 sparse_average=senders warm-up settle=0.5", None,
                   {"local_steps": 8, "sparse_average": "senders", "warmup_decay_steps": None,
                    "warmup_settle": SETTLE}))

ABLATED = {label for _, label, _, _ in SETTLE_SCREEN + SENDERS_SCREEN} | {label for label, _ in LM_ABLATION} | {label for label, _, _ in ADAMW_ABLATION} | \
    {label for label, slim in OVERLAP_ABLATION if slim} | \
    {label for label, _, slim in LOCAL_ABLATION + LOCAL_GRID + LOCAL_SCREEN if slim}


def _config(case: str, variant: Tuple[str, str, Optional[float], Dict[str, Any]],
            base: Dict[str, Any]) -> Config:
    label, method, density, extra = variant
    # density None: no keyword at all, the shipped defaults (the table shows DEFAULT_DENSITY).
    return (f"{case} {label}", method, density, {}, dict(base, case=case, variant=label,
                                                        **extra))


def configs(group: str) -> List[Config]:
    """``untuned``: every case x (dense, default, 0.001); ``untuned-peers``: the peers on the
    plotted case; ``lm`` and ``lm-peers``: the same for the language model."""
    if group == "untuned":
        return [_config(case, v, {**CNN, **over}) for case, over in CASES.items()
                for v in VARIANTS]
    if group == "untuned-peers":
        return [_config("sgd-m0.5", p, {**CNN, **CASES["sgd-m0.5"]}) for p in PEERS]
    if group in ("lm", "lm-peers"):
        return [_config("lm", v, dict(LM)) for v in (VARIANTS if group == "lm" else PEERS)]
    if group == "lm-ablation":
        return [(f"lm {label}", "slim", None, slim, dict(LM, case="lm", variant=label))
                for label, slim in LM_ABLATION]
    if group in ("overlap-ablation", "local-steps"):
        case = "sgd-m0.5"
        runs = [(label, None, slim) for label, slim in OVERLAP_ABLATION] \
            if group == "overlap-ablation" else list(LOCAL_ABLATION)
        return [(f"{case} {label}", "slim", density, slim,
                 dict(CNN, **CASES[case], case=case, variant=label))
                for label, density, slim in runs] + \
            [(f"lm {label}", "slim", density, slim, dict(LM, case="lm", variant=label))
             for label, density, slim in runs]
    if group == "local-grid":
        case = "sgd-m0.5"
        return [(f"{case} {label}", "slim", density, slim,
                 dict(CNN, **CASES[case], case=case, variant=label))
                for label, density, slim in LOCAL_GRID] + \
            [(f"lm {label}", "slim", density, slim, dict(LM, case="lm", variant=label))
             for label, density, slim in LOCAL_GRID]
    if group == "local-defaults":
        return [(f"lm {label}", "slim", density, slim, dict(LM, case="lm", variant=label))
                for label, density, slim in LOCAL_SCREEN]
    if group in ("warmup-settle", "sparse-average"):
        return [(f"{case} {label}", "slim", density, slim,
                 dict(LM if case == "lm" else dict(CNN, **CASES[case]), case=case,
                      variant=label))
                for case, label, density, slim in
                (SETTLE_SCREEN if group == "warmup-settle" else SENDERS_SCREEN)]
    if group == "untuned-ablation":
        case = "adamw-warmup"
        return [(f"{case} {label}", "slim", density, slim,
                 dict(CNN, **CASES[case], case=case, variant=label))
                for label, density, slim in ADAMW_ABLATION]
    raise ValueError(f"unknown group {group!r}")


GROUPS = ("untuned", "untuned-peers", "lm", "lm-peers")
# on request (--groups ...), not by default
EXTRA_GROUPS = ("lm-ablation", "untuned-ablation", "overlap-ablation", "local-steps",
                "local-grid", "local-defaults", "warmup-settle", "sparse-average")


# --- the report ------------------------------------------------------------------------------
def _mean(xs: List[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def _metric(run: Dict[str, Any]) -> str:
    return "val_bpb" if run["dataset"] == "pystdlib" else "test_accuracy"


def compressed_ratios(run: Dict[str, Any]) -> Tuple[Optional[float], Optional[float]]:
    """The compressed tensors' dense bytes over their pushed and pulled bytes (values and
    indices; the dense small tensors and headers apart), over the whole run."""
    b = run["records"][-1].get("breakdown")
    if not b:
        return None, None
    push = b["push_sparse_value_bytes"] + b["push_index_bytes"]
    pull = b["pull_sparse_value_bytes"] + b["pull_index_bytes"]
    dense = b["compressed_dense_bytes"]
    return (dense / push if push else None), (dense / pull if pull else None)


def summarise(runs: List[Dict[str, Any]]) -> "OrderedDict[Tuple[str, str], Dict[str, Any]]":
    """Per (case, variant): seeds, metric after epoch 1 and at the end (means), the final metric
    after flush, the compressed bytes ratios and the dense small tensors' share of a push."""
    groups: "OrderedDict[Tuple[str, str], List[Dict[str, Any]]]" = OrderedDict()
    for r in runs:
        if r.get("case") and not r.get("diverged") and r.get("records"):
            groups.setdefault((r["case"], r["variant"]), []).append(r)
    out: "OrderedDict[Tuple[str, str], Dict[str, Any]]" = OrderedDict()
    for key, rs in groups.items():
        m = _metric(rs[0])
        ratios = [compressed_ratios(r) for r in rs]
        last = [r["records"][-1] for r in rs]
        out[key] = {
            "seeds": len(rs), "metric": m, "epoch1": _mean([r["records"][0][m] for r in rs]),
            "end": _mean([x[m] for x in last]),
            "flushed": _mean([x.get("flushed_accuracy", x.get("flushed_val_bpb", float("nan")))
                              for x in last]),
            "push_ratio": _mean([p for p, _ in ratios if p]) if any(p for p, _ in ratios)
            else None,
            "pull_ratio": _mean([q for _, q in ratios if q]) if any(q for _, q in ratios)
            else None,
            "pushed": _mean([x["bytes_pushed"] / max(x["steps"], 1) for x in last]),
            "pulled": _mean([x["bytes_pulled"] / max(x["steps"], 1) for x in last]),
            "dense": _mean([x["dense_bytes"] / max(x["steps"], 1) for x in last]),
            "seconds": _mean([r["seconds"] for r in rs]),
            "end_by_seed": {r["seed"]: r["records"][-1][m] for r in rs},
            "epoch1_by_seed": {r["seed"]: r["records"][0][m] for r in rs},
            "load": _mean([r.get("loadavg", [float("nan")])[0] for r in rs])}
    return out


def paired_gap(row: Dict[str, Any], ref: Dict[str, Any], key: str) -> float:
    """``row``'s ``key`` ("epoch1" or "end") less ``ref``'s over the seeds both ran (over all
    of ``ref``'s when they share none): a dense reference on more seeds than a peer would
    otherwise lend the peer their spread."""
    mine, theirs = row[f"{key}_by_seed"], ref[f"{key}_by_seed"]
    common = [s for s in mine if s in theirs]
    if not common:
        return row[key] - ref[key]
    return _mean([mine[s] for s in common]) - _mean([theirs[s] for s in common])


def _gap(row: Optional[Dict[str, Any]], ref: Optional[Dict[str, Any]], key: str) -> str:
    if row is None or ref is None:
        return ""
    return f"{paired_gap(row, ref, key):+.2f}"


def _verdict(gap: float, target: float) -> str:
    return "met" if -gap <= target + 1e-9 else f"missed by {-gap - target:.2f}"


def battery_table(rows: "OrderedDict[Tuple[str, str], Dict[str, Any]]") -> str:
    """Test accuracy (%) per case: dense, the defaults and 0.001, with the gaps and verdicts."""
    out = ["| script | seeds | dense, epoch 1 | dense, end | defaults, epoch 1 | Δ | defaults, "
           "end | Δ | 0.001, end | Δ | targets (epoch 1 ≤ 1.0, end ≤ 0.3 / ≤ 0.5) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for case in CASES:
        dense, dflt, low = (rows.get((case, v)) for v in ("dense", "default", "0.001"))
        if dense is None:
            continue
        verdicts = []
        if dflt is not None:
            verdicts.append("epoch 1 " + _verdict(paired_gap(dflt, dense, "epoch1"), 1.0))
            verdicts.append("end " + _verdict(paired_gap(dflt, dense, "end"), 0.3))
        if low is not None:
            verdicts.append("0.001 " + _verdict(paired_gap(low, dense, "end"), 0.5))
        seeds = "/".join(str(r["seeds"]) for r in (dense, dflt, low) if r is not None)
        cell = lambda r, k: "" if r is None else f"{r[k]:.2f}"  # noqa: E731
        out.append(f"| {case} | {seeds} | {dense['epoch1']:.2f} | {dense['end']:.2f} "
                   f"| {cell(dflt, 'epoch1')} | {_gap(dflt, dense, 'epoch1')} "
                   f"| {cell(dflt, 'end')} | {_gap(dflt, dense, 'end')} | {cell(low, 'end')} "
                   f"| {_gap(low, dense, 'end')} | {'; '.join(verdicts)} |")
    return "\n".join(out) + "\n"


def bytes_table(rows: "OrderedDict[Tuple[str, str], Dict[str, Any]]") -> str:
    """The compressed tensors' dense bytes over what hvd_slim pushed and pulled for them, whole
    runs (the warm-up included); the dense small tensors travel apart and are shown apart."""
    out = ["| script | defaults: dense/pushed | dense/pulled | 0.001: dense/pushed | dense/pulled "
           "| all pushed B/step (defaults) | of which dense small tensors + headers |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    ratio = lambda r, k: "" if r is None or r[k] is None else f"{r[k]:.0f}x"  # noqa: E731
    for case in list(CASES) + ["lm"]:
        dflt, low = rows.get((case, "default")), rows.get((case, "0.001"))
        if dflt is None:
            continue
        small = dflt["pushed"] - dflt["dense"] / dflt["push_ratio"] if dflt["push_ratio"] else 0
        out.append(f"| {case} | {ratio(dflt, 'push_ratio')} | {ratio(dflt, 'pull_ratio')} "
                   f"| {ratio(low, 'push_ratio')} | {ratio(low, 'pull_ratio')} "
                   f"| {dflt['pushed']:,.0f} | {small:,.0f} |")
    return "\n".join(out) + "\n"


def lm_table(rows: "OrderedDict[Tuple[str, str], Dict[str, Any]]") -> str:
    """Validation bits per byte of the language model (lower is better) and the peers."""
    dense = rows.get(("lm", "dense"))
    if dense is None:
        return ""
    out = ["| run | seeds | val bits/byte | vs dense (same seeds) | after flush | pushed B/step "
           "| pulled B/step | target |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for (case, variant), r in rows.items():
        if case != "lm":
            continue
        # Against dense over the same seeds (a 1-seed peer against seed 0's dense, not the mean).
        ref = _mean([dense["end_by_seed"][seed] for seed in r["end_by_seed"]
                     if seed in dense["end_by_seed"]]) if r is not dense else dense["end"]
        rel = r["end"] / ref - 1
        target = TARGETS["lm"].get(variant)
        verdict = "" if target is None else ("met" if rel <= target + 1e-12 else
                                             f"missed by {100 * (rel - target):.2f}%")
        out.append(f"| {variant} | {r['seeds']} | {r['end']:.4f} | {100 * rel:+.2f}% "
                   f"| {r['flushed']:.4f} | {r['pushed']:,.0f} | {r['pulled']:,.0f} "
                   f"| {verdict} |")
    return "\n".join(out) + "\n"


def ablation_table(rows: "OrderedDict[Tuple[str, str], Dict[str, Any]]") -> str:
    """The battery's ablation rows (a default with one keyword changed) against dense and
    against the unchanged variant they come from."""
    out = ["| script | run | seeds | epoch 1 | Δ dense | end | Δ dense | Δ unchanged |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for (case, variant), r in rows.items():
        dense = rows.get((case, "dense"))
        if case == "lm" or variant not in ABLATED or dense is None:
            continue
        base = rows.get((case, variant.split(" ")[0]))   # "default ..." -> "default"
        out.append(f"| {case} | {variant} | {r['seeds']} | {r['epoch1']:.2f} "
                   f"| {_gap(r, dense, 'epoch1')} | {r['end']:.2f} | {_gap(r, dense, 'end')} "
                   f"| {_gap(r, base, 'end')} |")
    return "\n".join(out) + "\n" if len(out) > 2 else ""


def peers_table(rows: "OrderedDict[Tuple[str, str], Dict[str, Any]]", case: str) -> str:
    """Every run of ``case`` (hvd_slim and the peers): the final metric and bytes a step."""
    sub = [(v, r) for (c, v), r in rows.items() if c == case]
    if not sub:
        return ""
    name = "val bits/byte" if sub[0][1]["metric"] == "val_bpb" else "test accuracy %"
    out = [f"| {case} | seeds | {name} | pushed B/step | pulled B/step | dense B/step |",
           "|---|---:|---:|---:|---:|---:|"]
    for v, r in sub:
        out.append(f"| {v} | {r['seeds']} | {r['end']:.4g} | {r['pushed']:,.0f} "
                   f"| {r['pulled']:,.0f} | {r['dense']:,.0f} |")
    return "\n".join(out) + "\n"


def plot(runs: List[Dict[str, Any]], out: str) -> List[str]:
    """Accuracy (bits per byte for the LM) against the MB each rank pushed and pulled, one
    panel per plotted case: a curve per run variant through its evaluation points, seed means."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    from .time_to_accuracy import points, save_figure
    written = []
    for case in PLOTTED:
        by: "OrderedDict[str, List[Dict[str, Any]]]" = OrderedDict()
        for r in runs:
            if r.get("case") == case and r.get("records") and not r.get("diverged") \
                    and r["variant"] not in ABLATED:
                by.setdefault(r["variant"], []).append(r)
        if not by:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for variant, rs in by.items():
            m = _metric(rs[0])
            pts = [points(r) for r in rs]
            n = min(len(p) for p in pts)
            xs = [_mean([(p[i]["bytes_pushed"] + p[i]["bytes_pulled"]) / 1e6 for p in pts])
                  for i in range(n)]
            ys = [_mean([p[i][m] for p in pts]) for i in range(n)]
            style = {"color": "black", "linewidth": 2} if variant == "dense" else \
                {"linestyle": "--"} if variant.startswith(("top-k", "PowerSGD")) else {}
            ax.plot(xs, ys, marker="o", markersize=3, label=variant, **style)
        ax.set_xscale("log")
        finish_axes(ax, case, "MB pushed + pulled by rank 0 (cumulative)",
                    f"{case}: mean over seeds, 4 ranks", legend=8)
        written.append(save_figure(fig, os.path.join(out, f"untuned_{case}_vs_bytes.png")))
    return written


def finish_axes(ax: Any, case: str, xlabel: str, title: str, legend: int) -> None:
    """Labels, grid and legend of a metric-against-something plot of ``case``."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation bits per byte" if case == "lm" else "test accuracy (%)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=legend)


def report(runs: List[Dict[str, Any]], out: str) -> str:
    """Write ``untuned.md`` (every table above) and the plots into ``out``; return the text.
    The local-steps grid's runs are local_grid.md's."""
    grid = {label for label, _, _ in LOCAL_GRID}
    runs = [r for r in runs if r.get("variant") not in grid]
    rows = summarise(runs)
    if not rows:
        return ""
    parts = ["## Untuned scripts (Horovod's MNIST example CNN, 4 ranks)\n",
             battery_table(rows), "\n**Bytes** (the compressed tensors only, whole run)\n",
             bytes_table(rows)]
    ablated = ablation_table(rows)
    if ablated:
        parts += ["\n**One keyword changed** (what the defaults' choice is worth)\n", ablated]
    if any(c == "lm" for c, _ in rows):
        parts += ["\n## Language model (byte-level transformer, standard library sources)\n",
                  lm_table(rows)]
    for case in PLOTTED:
        parts += [f"\n**{case}: hvd_slim and its peers**\n", peers_table(rows, case)]
    loads = [r["load"] for r in rows.values() if r["load"] == r["load"]]
    if loads:
        parts.append(f"\nMachine load (1-minute average at the start of the runs): "
                     f"{min(loads):.1f} to {max(loads):.1f}.\n")
    text = "".join(parts)
    with open(os.path.join(out, "untuned.md"), "w", encoding="utf-8") as f:
        f.write(text)
    for path in plot(runs, out):
        text += f"\nwrote {path}"
    return text
