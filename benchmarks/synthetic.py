"""Horovod's synthetic benchmark as a user runs it, on the switched cluster.

    python -m benchmarks.synthetic [--np 4] [--rate 1gbit] [--repeats 2] [--out DIR] [-- FLAGS]

examples/synthetic_benchmark.py is shaped like Horovod's ``pytorch_synthetic_benchmark.py``
(ResNet-18 on random images, img/s over timed iterations). It runs three ways, its one import
line swapped: Horovod, Horovod with ``--fp16-allreduce``, and hvd_slim at its defaults, each
rank a host of benchmarks/cluster.py's switched cluster (one NIC per host at ``--rate``). The
three alternate ``--repeats`` times in one sitting, since this machine's speed drifts between
sittings. What a user sees is what is timed: hvd_slim's automatic warm-up (denser slices over
the first 1/density steps) runs inside the timed iterations as it would in theirs.

Needs root and network namespaces (as ``make bench``), and Horovod (``make install-horovod``):
without it only hvd_slim runs, saying so. FLAGS go to the example; the default is Horovod's shape
of run (10 warm-up batches, 10 iterations of 10) at batch 16 and 64x64 images, sized for CPUs.
Writes ``synthetic.json`` and ``synthetic.md`` to ``--out``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
from typing import Any, Dict, List, Optional, Tuple

from . import cluster, netem
from .launch import ROOT, run_session, session_env
from .machine import describe as describe_machine

EXAMPLE = os.path.join(ROOT, "examples", "synthetic_benchmark.py")
SLIM_IMPORT = "import hvd_slim as hvd  # was: import horovod.torch as hvd"
HOROVOD_IMPORT = "import horovod.torch as hvd"
SHAPE = ["--batch-size", "16", "--image-size", "64", "--num-warmup-batches", "10",
         "--num-batches-per-iter", "10", "--num-iters", "10"]


def horovod_copy(folder: str) -> str:
    """The example with Horovod's import in place of hvd_slim's, written into ``folder``."""
    with open(EXAMPLE, encoding="utf-8") as f:
        source = f.read()
    if source.count(SLIM_IMPORT) != 1:
        raise RuntimeError(f"{EXAMPLE} no longer has the line {SLIM_IMPORT!r} to swap")
    path = os.path.join(folder, "synthetic_horovod.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(source.replace(SLIM_IMPORT, HOROVOD_IMPORT))
    return path


def runtimes(folder: str, horovod: bool) -> List[Tuple[str, List[str]]]:
    """(name, the rank's command) for each way the example runs."""
    slim = [sys.executable, "-m", "examples.synthetic_benchmark"]
    if not horovod:
        return [("hvd_slim", slim)]
    copy = [sys.executable, horovod_copy(folder)]
    return [("horovod", copy), ("horovod-fp16", [*copy, "--fp16-allreduce"]),
            ("hvd_slim", slim)]


def summarise(runs: Dict[str, List[Dict[str, Any]]], np_: int) -> Dict[str, Dict[str, float]]:
    """Per runtime: the total img/s of each repeat, their mean, and the ratio to Horovod's."""
    out: Dict[str, Dict[str, float]] = {}
    for name, logs in runs.items():
        totals = [np_ * log["mean"] for log in logs]
        out[name] = {"repeats": len(totals), "img_sec_total": statistics.fmean(totals),
                     "min": min(totals), "max": max(totals)}
    base = out.get("horovod")
    for row in out.values():
        row["vs_horovod"] = row["img_sec_total"] / base["img_sec_total"] if base else float("nan")
    return out


def table(summary: Dict[str, Dict[str, float]]) -> str:
    lines = ["| runtime | repeats | total img/s (mean) | range | vs Horovod |",
             "|---|---:|---:|---:|---:|"]
    for name, r in summary.items():
        lines.append(f"| {name} | {r['repeats']} | {r['img_sec_total']:.1f} | "
                     f"{r['min']:.1f}-{r['max']:.1f} | {r['vs_horovod']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.synthetic",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=4, help="ranks, one host each")
    ap.add_argument("--rate", default="1gbit", help="each host's NIC rate")
    ap.add_argument("--repeats", type=int, default=2, help="alternations of the runtimes")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds before a run is killed")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "synthetic"))
    ap.add_argument("flags", nargs="*", help="the example's flags, after --")
    args = ap.parse_args(argv)
    if args.np < 2 or args.repeats < 1:
        ap.error(f"--np must be at least 2 and --repeats at least 1, got {args.np} and "
                 f"{args.repeats}")
    spec = cluster.ClusterSpec(hosts=args.np, rate=args.rate)
    netem.check_privileges()   # no loopback fallback: the figures are about the wire
    horovod = importlib.util.find_spec("horovod") is not None
    if not horovod:
        print("benchmarks.synthetic: Horovod is not installed (make install-horovod); only "
              "hvd_slim runs", flush=True)
    os.makedirs(args.out, exist_ok=True)
    flags = args.flags or SHAPE
    env = dict(session_env(), OMP_NUM_THREADS="1")
    runs: Dict[str, List[Dict[str, Any]]] = {}
    loads = [os.getloadavg()]
    with tempfile.TemporaryDirectory() as folder, cluster.switched(spec) as c:
        ways = runtimes(folder, horovod)   # the Horovod copy is written once
        for repeat in range(args.repeats):
            for name, command in ways:
                out = os.path.join(folder, f"{name}_{repeat}.json")
                argv_ = c.mpirun_argv(args.np, [*command, *flags, "--json", out],
                                      ("OMP_NUM_THREADS",))
                rc, text, seconds = run_session(argv_, args.timeout, dict(env, **c.env()))
                if rc != 0:
                    print(text[-3000:], file=sys.stderr)
                    print(f"benchmarks.synthetic: {name} (repeat {repeat}) exited {rc}",
                          file=sys.stderr)
                    return 1
                with open(out, encoding="utf-8") as f:
                    log = json.load(f)
                runs.setdefault(name, []).append(log)
                print(f"[synthetic] {name} repeat {repeat}: {args.np * log['mean']:.1f} img/s "
                      f"in total ({seconds:.0f} s)", flush=True)
                loads.append(os.getloadavg())
        network = c.describe()
    summary = summarise(runs, args.np)
    record = {"command": "python -m benchmarks.synthetic " + " ".join(argv or sys.argv[1:]),
              "flags": flags, "network": network, "machine": describe_machine(),
              "loadavg": loads, "runs": runs, "summary": summary}
    with open(os.path.join(args.out, "synthetic.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
    text = (f"# Horovod's synthetic benchmark, {args.np} hosts at {args.rate}\n\n"
            f"`{record['command']}`; the example's flags: `{' '.join(flags)}`.\n\n"
            + table(summary) + f"\nMachine load (1-minute average, before and after each run): "
            f"{min(x[0] for x in loads):.1f} to {max(x[0] for x in loads):.1f}.\n")
    with open(os.path.join(args.out, "synthetic.md"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
