"""Convergence study: dense training vs hvd_slim (Slim-DP) on real MNIST and MNIST-1D, 4 ranks.

    .venv/bin/python benchmarks/convergence.py                  # the study (make convergence)
    .venv/bin/python benchmarks/convergence.py --preset quick   # 1 seed, MNIST-1D only
    .venv/bin/python benchmarks/convergence.py --groups ablation
    .venv/bin/python benchmarks/convergence.py --report-only     # table and plots from results

Groups of runs (each config x each seed x each dataset):

* ``grid``: dense, and hvd_slim at density 0.01 and 0.001, each with pull "slim" and "union" and
  exploration 0 and 0.1 (the issue's study).
* ``kept``: the earlier results at the shipped defaults (density 0.02 passed explicitly, every
  other keyword left alone) and at 0.001: SGD with momentum 0.9 and the cosine schedule
  (``SETTINGS``), and Adam, against dense.
* ``baselines``: the top-k + error-feedback allgather baseline (examples/topk.py) at both densities.
* ``ablation``: hvd_slim's defaults with one knob changed: momentum correction off, its
  velocity kept (``momentum_masking=False``) or halved (0.5) where a coordinate is sent, core fixed
  for 4 steps, magnitude weight 0.1, a 4x denser pull, a dense warm-up over the first 10% of
  the steps (emulated outside hvd_slim: examples/training.py ``DenseWarmup``), hvd_slim's own
  warm-up (``warmup_dense_steps``: the first 10% dense; and 5% dense then a geometric decay over
  the next 10%).
* ``adam``: dense Adam, and hvd_slim under Adam at both densities: the default
  (``adam_variance="rescaled"``), Adam's own step on the bursts (``"live"``), and the default
  after hvd_slim's warm-up (5% dense, 10% decay).
* ``schedule``: dense and slim with a constant LR instead of the cosine decay, and with the
  cosine applied by scaling the loss instead of the LR (``training.Schedule``'s ``via``).
* ``longer``: dense and slim trained for twice the epochs (MNIST: 4).
* ``time``: time to accuracy at the ``longer`` settings: dense, Horovod's own
  DistributedOptimizer (run through examples/mnist.py: one MPI runtime per process), slim at
  0.01 and slim at 0.001 with a 4x pull (``pull_density=0.004``). Seeds are interleaved
  (seed 0 of every config, then seed 1, ...) so that load drift on a shared machine hits every
  config alike. Meant for ``--net tbf1g``.

``--net tbf1g``/``tbf10g`` runs every job inside benchmarks/netem.py's emulated network (a
network namespace whose loopback carries a ``tc tbf`` rate limit; Open MPI over TCP on that
``lo`` only), measures the link once with a 16 MiB ping-pong (benchmarks/worker.py) and stores
both in every result (``network``); keys get an ``@<net>`` suffix. The namespace is removed
afterwards, also on failure. Needs root.

Every run of a dataset uses the same epochs, batch size and LR schedule (``SETTINGS``). The
runs go to examples/sweep.py inside one ``mpirun`` per dataset (interpreter start-up and data
loading dominate short runs here); finished runs are appended to ``results.jsonl`` and skipped
on the next invocation, so an interrupted study resumes. The report is ``table.md`` (with a
"time to 98.5%" table per network for MNIST runs that carry timed evaluations) plus
``<dataset>_accuracy_vs_epoch.png`` and ``<dataset>_accuracy_vs_bytes.png`` in ``--out``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # benchmarks.netem when run as a script
from benchmarks import netem, untuned  # noqa: E402

# MNIST: 2 epochs (what 2 shared cores allow for 3 seeds x the grid), cosine decay so the
# comparison is of converged-ish models, not of where a constant LR happens to leave them.
# MNIST-1D: 20 short epochs of an MLP that cannot saturate the task.
SETTINGS = {"mnist": {"epochs": 2, "batch_size": 64, "lr": 0.05, "schedule": "cosine",
                      "evals_per_epoch": 2},  # 4 points for the curves, not 2
            "mnist1d": {"epochs": 20, "batch_size": 32, "lr": 0.05, "schedule": "cosine"}}
# Seconds one epoch may take on a loaded 2-core machine at 4 ranks (for the hard timeout).
EPOCH_BUDGET_S = {"mnist": 90, "mnist1d": 8, "pystdlib": 1800}
TARGET_GAP = {0.02: 0.3, 0.01: 0.3, 0.001: 0.5}  # the issue's targets, points below dense
TTA_TARGET = {"mnist": 98.5}  # time to this test accuracy (%), per dataset
NET_SLOWDOWN = {"loopback": 1.0, "tbf10g": 1.2, "tbf1g": 1.5}  # timeout allowance per network
INTERLEAVED = ("time",)  # groups planned seed-major (see the module docstring)
# What `make convergence` runs: the untuned battery and the language model first (the README's
# lead results), then the MNIST / MNIST-1D grid and the top-k baselines.
DEFAULT_GROUPS = untuned.GROUPS + ("kept", "grid", "baselines")
# (name, method, density, Slim-DP keywords, other spec fields)
Config = Tuple[str, str, float, Dict[str, Any], Dict[str, Any]]
sys.path.insert(0, os.path.join(ROOT, "examples"))  # launch.py, report.py


def configs(group: str) -> List[Config]:
    """The configurations of one group (see the module docstring)."""
    if group in untuned.GROUPS + untuned.EXTRA_GROUPS:
        return untuned.configs(group)
    if group == "grid":
        out: List[Config] = [("dense", "dense", 1.0, {}, {})]
        for d in (0.01, 0.001):
            for pull in ("slim", "union"):
                for eps in (0.0, 0.1):
                    out.append((f"slim d={d:g} pull={pull} expl={eps:g}", "slim", d,
                                {"pull": pull, "exploration": eps}, {}))
        return out
    if group == "kept":
        adam: Dict[str, Any] = {"optimizer": "adam", "lr": 1e-3}
        return ([("dense", "dense", 1.0, {}, {}), ("dense adam", "dense", 1.0, {}, adam)]
                + [(f"slim d={d:g}{tag}", "slim", d, {}, extra) for d in (0.02, 0.001)
                   for tag, extra in (("", {}), (" adam", adam))])
    if group == "baselines":
        return [(f"topk d={d:g}", "topk", d, {}, {}) for d in (0.01, 0.001)]
    if group == "ablation":
        out = []
        for d in (0.01, 0.001):
            knobs = [("mc=off", {"momentum_correction": False}, {}),
                     ("mc masking off", {"momentum_masking": False}, {}),
                     ("mc masking 0.5", {"momentum_masking": 0.5}, {}),
                     ("q=4", {"refresh_interval": 4}, {}),
                     ("lambda=0.1", {"magnitude_weight": 0.1}, {}),
                     ("pull_density=4d", {"pull_density": 4 * d}, {}),
                     ("dense warm-up 10%", {}, {"dense_warmup_fraction": 0.1}),
                     # hvd_slim's own warm-up: dense steps, then a geometric density decay
                     ("warm-up 10% dense", {}, {"slim_warmup_fraction": (0.1, 0.0)}),
                     ("warm-up 5% dense + 10% decay", {}, {"slim_warmup_fraction": (0.05, 0.1)})]
            out += [(f"slim d={d:g} {label}", "slim", d, slim, extra)
                    for label, slim, extra in knobs]
        return out
    if group == "adam":  # against dense Adam (rows ending in "adam"; report.REFERENCE_TAGS)
        adam: Dict[str, Any] = {"optimizer": "adam", "lr": 1e-3}
        out = [("dense adam", "dense", 1.0, {}, adam)]
        for d in (0.01, 0.001):
            out += [(f"slim d={d:g} adam", "slim", d, {}, adam),   # adam_variance="rescaled"
                    (f"slim d={d:g} live-variance adam", "slim", d, {"adam_variance": "live"},
                     adam),
                    (f"slim d={d:g} warm-up 5% dense + 10% decay adam", "slim", d, {},
                     dict(adam, slim_warmup_fraction=(0.05, 0.1)))]
        return out
    if group == "schedule":  # a constant LR instead of cosine; the cosine applied via the loss
        return (_paired("constant-LR", {"schedule": "constant"})
                + _paired("cosine-in-loss", {"lr_via": "loss"}))
    if group == "longer":  # twice the epochs: is the gap a delay that more training closes?
        return _paired("4-epochs", {"epochs": 4})
    if group == "time":  # the "longer" settings; Horovod; 0.001 with its 4x pull
        four = {"epochs": 4}
        return [("dense 4-epochs", "dense", 1.0, {}, four),
                ("horovod 4-epochs", "horovod", 1.0, {}, four),
                ("slim d=0.01 4-epochs", "slim", 0.01, {}, four),
                ("slim d=0.001 pull_density=4d 4-epochs", "slim", 0.001,
                 {"pull_density": 0.004}, four)]
    raise ValueError(f"unknown group {group!r}")


def _paired(tag: str, extra: Dict[str, Any]) -> List[Config]:
    """Dense and slim (both densities, defaults otherwise) with the same change ``extra``; the
    report compares a "<config> <tag>" row with "dense <tag>"."""
    return [(f"dense {tag}", "dense", 1.0, {}, extra)] + [
        (f"slim d={d:g} {tag}", "slim", d, {}, extra) for d in (0.01, 0.001)]


def steps_per_epoch(dataset: str, batch: int, np_: int) -> int:
    """DistributedSampler's shard size over the batch size (train sizes are fixed)."""
    n = {"mnist": 60000, "mnist1d": 9600}[dataset]
    return math.ceil(math.ceil(n / np_) / batch)


def build_plan(datasets: List[str], groups: List[str], seeds: List[int], np_: int,
               net: str = "loopback") -> List[dict]:
    """One spec (see examples/sweep.py) per dataset x config x seed; dense rows come first.
    Keys of runs on an emulated network end in ``@<net>``; loopback keys have no suffix."""
    if net not in netem.NETS:
        raise ValueError(f"net must be one of {sorted(netem.NETS)}, got {net!r}")
    suffix = "" if net == "loopback" else f"@{net}"
    plan = []
    for ds in datasets:
        s = SETTINGS.get(ds, {})
        for group in groups:
            # The untuned battery and the language model fix their own data set and settings.
            cfgs = [c for c in configs(group)
                    if c[4].get("dataset", ds if ds in SETTINGS else None) == ds]
            pairs = ([(c, seed) for seed in seeds for c in cfgs] if group in INTERLEAVED
                     else [(c, seed) for c in cfgs for seed in seeds])
            for (name, method, density, slim, extra), seed in pairs:
                extra = dict(extra)
                frac = extra.pop("dense_warmup_fraction", 0.0)
                dense_frac, decay_frac = extra.pop("slim_warmup_fraction", (0.0, 0.0))
                if frac or dense_frac or decay_frac:
                    total = s["epochs"] * steps_per_epoch(ds, s["batch_size"], np_)
                if frac:
                    extra["dense_warmup_steps"] = int(frac * total)
                if dense_frac or decay_frac:   # from dense, as these rows were first measured
                    slim = dict(slim, warmup_dense_steps=int(dense_frac * total),
                                warmup_decay_steps=int(decay_frac * total),
                                warmup_start_density=1.0)
                plan.append({"key": f"{ds}/{name}/seed{seed}{suffix}", "dataset": ds,
                             "group": group, "config": name, "method": method,
                             "density": density, "slim": slim, "seed": seed, "net": net,
                             **s, **extra})
    return plan


def segments(plan: List[dict]) -> List[Tuple[str, List[dict]]]:
    """The plan cut into jobs, in order: ("horovod", [spec]) for each Horovod run (one MPI
    runtime per process: examples/mnist.py), ("sweep", specs) for each stretch of others of
    one dataset (one examples/sweep.py job amortises start-up and data loading)."""
    out: List[Tuple[str, List[dict]]] = []
    for spec in sorted(plan, key=lambda s: s["dataset"]):  # stable: plan order within one
        if spec["method"] == "horovod":
            out.append(("horovod", [spec]))
        elif out and out[-1][0] == "sweep" and out[-1][1][-1]["dataset"] == spec["dataset"]:
            out[-1][1].append(spec)
        else:
            out.append(("sweep", [spec]))
    return out


PINGPONG = ("import json; from mpi4py import MPI; from benchmarks.worker import pingpong; "
            "r = pingpong(MPI.COMM_WORLD, {mib}); "
            "MPI.COMM_WORLD.Get_rank() == 0 and print('PINGPONG ' + json.dumps(r), flush=True)")


def network_record(net: str, ns: Optional[str], mib: int = 16) -> Dict[str, Any]:
    """What every result on ``net`` stores: the net, the qdisc in force and, on an emulated
    network, the rate a 2-rank ``mib`` MiB ping-pong measured (benchmarks/worker.py)."""
    from launch import MpiTimeout, run  # examples/launch.py
    record: Dict[str, Any] = {"net": net, "qdisc": netem.qdisc(ns)}
    if ns is None or mib <= 0:
        return record
    try:
        rc, text = run(2, [sys.executable, "-c", PINGPONG.format(mib=mib)], 180,
                       mpi_args=netem.mpi_args(net), prefix=netem.wrap(ns, []))
    except MpiTimeout as exc:
        rc, text = -1, exc.output
    found = [json.loads(line[len("PINGPONG "):]) for line in text.splitlines()
             if line.startswith("PINGPONG ")]
    if rc != 0 or not found:
        print(f"convergence: link calibration failed (exit {rc}):\n{text[-2000:]}", flush=True)
    else:
        record["pingpong"] = found[0]
        print(f"convergence: {net}: a {mib} MiB ping-pong measured "
              f"{found[0]['gbit_per_s']:.3f} Gbit/s", flush=True)
    return record


def launch(plan: List[dict], results: str, np_: int, out: str, net: str = "loopback") -> None:
    """Run the plan's unfinished runs under mpirun (inside the emulated network for a
    ``net`` other than loopback), one job per segment, each under a hard timeout."""
    from launch import MpiTimeout, run  # examples/launch.py
    import mnist  # examples/mnist.py: spec_argv, spec_result
    done = {r["key"] for r in load(results)}
    todo = [s for s in plan if s["key"] not in done]
    print(f"convergence: {len(todo)} of {len(plan)} runs to do on {net}", flush=True)
    if not todo:
        return
    try:
        with netem.namespace(net) as ns:
            network = network_record(net, ns)
            opts = {"mpi_args": netem.mpi_args(net), "prefix": netem.wrap(ns, [])}
            for kind, part in segments(todo):
                part = [dict(s, network=network) for s in part]
                ds = part[0]["dataset"]
                timeout = 120 + NET_SLOWDOWN[net] * sum(EPOCH_BUDGET_S[ds] * s["epochs"]
                                                        for s in part)
                # The plan file or log is transient: every result line carries its own spec.
                tmp = os.path.join(out, f".{kind}_{ds}_{os.getpid()}.json")
                if kind == "sweep":
                    with open(tmp, "w", encoding="utf-8") as f:
                        json.dump(part, f, indent=1)
                    command = [sys.executable, os.path.join(ROOT, "examples", "sweep.py"),
                               tmp, results]
                else:
                    command = [sys.executable, os.path.join(ROOT, "examples", "mnist.py"),
                               *mnist.spec_argv(part[0], tmp)]
                print(f"convergence: {ds}: {len(part)} runs on {np_} ranks ({net}), timeout "
                      f"{timeout:.0f}s: {shlex.join(command)}", flush=True)
                load0 = os.getloadavg()[0]
                try:
                    rc, _ = run(np_, command, timeout, capture=False, **opts)
                    if rc == 0 and kind == "horovod":
                        with open(tmp, encoding="utf-8") as f:
                            line = dict(mnist.spec_result(part[0], json.load(f)),
                                        loadavg=[load0, os.getloadavg()[0]])
                        with open(results, "a", encoding="utf-8") as f:
                            f.write(json.dumps(line) + "\n")
                except MpiTimeout as exc:
                    sys.exit(f"convergence: {exc}; rerun to resume")
                finally:
                    if os.path.exists(tmp):
                        os.remove(tmp)
                if rc != 0:
                    sys.exit(f"convergence: mpirun exited with {rc} for {ds}; rerun to resume")
    except netem.NetemError as exc:
        sys.exit(f"convergence: {exc}")


def load(results: str) -> List[dict]:
    if not os.path.exists(results):
        return []
    with open(results, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=("full", "quick"), default="full",
                   help="full: 3 seeds, both datasets; quick: seed 0, MNIST-1D only")
    p.add_argument("--datasets", default=None, help="comma-separated: mnist,mnist1d")
    p.add_argument("--groups", default=",".join(DEFAULT_GROUPS),
                   help="comma-separated: " + ",".join(untuned.GROUPS + untuned.EXTRA_GROUPS)
                        + ",kept,grid,baselines,ablation,adam,schedule,longer,time")
    p.add_argument("--seeds", default=None, help="comma-separated, default 0,1,2")
    p.add_argument("--np", type=int, default=4, dest="np_")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "convergence"))
    p.add_argument("--only", default=None, metavar="REGEX",
                   help="run only the configs whose name matches (re.search)")
    p.add_argument("--net", choices=sorted(netem.NETS), default="loopback",
                   help="run inside benchmarks/netem.py's emulated network (root); "
                        "tbf1g: 1 Gbit/s, tbf10g: 10 Gbit/s")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args()
    quick = args.preset == "quick"
    datasets = (args.datasets or ("mnist1d" if quick else "mnist1d,mnist,pystdlib")).split(",")
    seeds = [int(s) for s in (args.seeds or ("0" if quick else "0,1,2")).split(",")]
    groups = args.groups.split(",")
    os.makedirs(args.out, exist_ok=True)
    results = os.path.join(args.out, "results.jsonl")
    plan = build_plan(datasets, groups, seeds, args.np_, args.net)
    if args.only:
        plan = [s for s in plan if re.search(args.only, s["config"])]
    if not args.report_only:
        start = time.perf_counter()
        launch(plan, results, args.np_, args.out, args.net)
        print(f"convergence: runs finished in {time.perf_counter() - start:.0f}s", flush=True)
    from report import write_report  # examples/report.py: table and plots
    keys = {s["key"] for s in plan}
    runs = [r for r in load(results) if args.report_only or r["key"] in keys]
    # The untuned battery and the language model have a report of their own (untuned.md).
    print(untuned.report([r for r in runs if r.get("case")], args.out))
    grid = [r for r in runs if not r.get("case")]
    if grid:   # a battery-only run leaves the grid's table.md alone
        print(write_report(grid, args.out, TARGET_GAP, TTA_TARGET))


if __name__ == "__main__":
    main()
