"""Running the convergence study: each segment of the plan under ``mpirun`` with a hard
timeout (inside the emulated network for ``--net``), results appended to ``results.jsonl``,
then the reports. ``python -m benchmarks.convergence`` runs :func:`main`."""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import time
from typing import Any, Dict, List, Optional

from benchmarks import netem
from benchmarks.launch import ROOT, MpiTimeout, run

from . import fair, local_grid, train, untuned
from .plan import (DEFAULT_GROUPS, EPOCH_BUDGET_S, NET_SLOWDOWN, TARGET_GAP, TTA_TARGET,
                   build_plan, segments)
from .report import write_report

PINGPONG = ("import json; from mpi4py import MPI; from benchmarks.worker import pingpong; "
            "r = pingpong(MPI.COMM_WORLD, {mib}); "
            "MPI.COMM_WORLD.Get_rank() == 0 and print('PINGPONG ' + json.dumps(r), flush=True)")


def network_record(net: str, ns: Optional[str], mib: int = 16) -> Dict[str, Any]:
    """What every result on ``net`` stores: the net, the qdisc in force and, on an emulated
    network, the rate a 2-rank ``mib`` MiB ping-pong measured (benchmarks/worker.py)."""
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
                    command = [sys.executable, "-m", "benchmarks.convergence.sweep", tmp,
                               results]
                else:
                    command = [sys.executable, "-m", "benchmarks.convergence.train",
                               *train.spec_argv(part[0], tmp)]
                print(f"convergence: {ds}: {len(part)} runs on {np_} ranks ({net}), timeout "
                      f"{timeout:.0f}s: {shlex.join(command)}", flush=True)
                load0 = os.getloadavg()[0]
                try:
                    rc, _ = run(np_, command, timeout, capture=False, **opts)
                    if rc == 0 and kind == "horovod":
                        with open(tmp, encoding="utf-8") as f:
                            line = dict(train.spec_result(part[0], json.load(f)),
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
    """Every result line of ``results`` ([] when there is none yet)."""
    if not os.path.exists(results):
        return []
    with open(results, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    """The study's command line (see the package docstring)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.convergence",
                                description="Convergence study: dense vs hvd_slim, 4 ranks")
    p.add_argument("--preset", choices=("full", "quick"), default="full",
                   help="full: 3 seeds, both datasets; quick: seed 0, MNIST-1D only")
    p.add_argument("--datasets", default=None, help="comma-separated: mnist,mnist1d")
    p.add_argument("--groups", default=",".join(DEFAULT_GROUPS),
                   help="comma-separated: " + ",".join(untuned.GROUPS + fair.GROUPS
                                                        + untuned.EXTRA_GROUPS)
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
    keys = {s["key"] for s in plan}
    every = load(results)
    runs = [r for r in every if args.report_only or r["key"] in keys]
    # The untuned battery and the language model have a report of their own (untuned.md), of
    # every battery run in the results file: a run of one group adds its rows to it.
    battery = [r for r in every if r.get("case") and r.get("case") not in fair.CASES]
    print(untuned.report(battery, args.out))
    print(local_grid.report(battery, args.out))
    print(fair.report(every, args.out))
    # table.md is the whole grid of the results file, as untuned.md is the whole battery: a
    # rerun of some rows (--only) updates them; a battery-only run leaves it alone.
    if any(not r.get("case") for r in runs):
        print(write_report([r for r in every if not r.get("case")], args.out, TARGET_GAP,
                           TTA_TARGET))

