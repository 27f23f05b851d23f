"""The cluster benchmark: every series of ``make bench`` on the switched cluster, in one run.

    python -m benchmarks.cluster_study                  # all series (root; about an hour here)
    python -m benchmarks.cluster_study --series scaling --steps 5

Series (each one or more ``benchmarks.run`` jobs, results in ``--out``):

* ``peers``: every peer on ResNet-18 shapes (synthetic gradients), 4 hosts at 1 Gbit/s.
* ``compute``: real forward and backward passes (ResNet-18 on 32x32 images, the small CNN) at
  4 hosts, 1 Gbit/s, 2 ranks per core: each peer's step against the compute-only ``floor``.
* ``scaling``: 2, 4 and 8 hosts at 100 Mbit/s on a 1.1M-parameter model (synthetic gradients,
  so the wire dominates the 2 cores): step time and the busiest NIC's bytes against N.
* ``hosts``: 2 hosts of 2 ranks at 100 and 10 Mbit/s on the 1.1M-parameter model: the flat
  exchange, ``hierarchical=True`` and a shard per rank (and MPI's allreduce at 100 Mbit/s).
* ``hetero``: 4 hosts at 1 Gbit/s with one at 250 Mbit/s, once a worker's (host 3) and once
  the server's (host 0): how much each peer slows down.
* ``shared``: the old shared medium (every rank on one 1 Gbit/s link), for comparison.
* ``calibrate``: the ``peers``, ``compute``, ``hosts`` and ``scaling`` jobs again on the
  unshaped loopback: each peer's step with next to no wire time, this machine's local work at
  that N, which the cost model (``python -m benchmarks.model validate --local-from``) takes as
  a measured input. Run a file and its calibration in one sitting (``--only`` picks jobs by
  tag): the machine's speed drifts between sittings.

Then ``<out>/summary.md`` gathers the tables and ``<out>/scaling_*.png`` the plots.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

from . import run
from .study_report import summarise

SERIES = ("peers", "compute", "overlap", "scaling", "hosts", "hetero", "shared", "calibrate")
# hvd_slim at its default density (0.02, pull "slim") and at the 0.01 the peers are compared at
SUBSET = "floor,mpi-allreduce,horovod,ddp-powersgd-r1,topk-ef@0.01,hvd_slim-slim@0.02," \
         "hvd_slim-slim@0.01,hvd_slim-union@0.01,hvd_slim-sharded@0.01"
# A real backward: Horovod's allreduce starts inside it, in fp32 and fp16 (the model's overlap),
# and so do DDP's hooks, PowerSGD's and hvd_slim's
COMPUTE = SUBSET.replace("horovod,", "horovod,horovod-fp16,").replace(
    "ddp-powersgd-r1,", "ddp-powersgd-r1,ddp-slim,")
DENSITIES = "0.1,0.02,0.01,0.001"
PULLS = "slim,union,sharded"   # sharded: pull "slim" with a server shard per rank


def plan(series: List[str], steps: int) -> List[Dict[str, Any]]:
    """The benchmarks.run invocations, each with the tag its results are written under."""
    few = ["--steps", str(max(3, steps // 2)), "--warmup", "3"]
    jobs: List[Dict[str, Any]] = []
    if "peers" in series:
        jobs.append({"series": "peers", "tag": "peers_resnet18_4h_1g",
                     "argv": ["--model", "resnet18", "--ranks", "4", "--steps", str(steps),
                              "--densities", DENSITIES, "--pulls", PULLS]})
    if "compute" in series:
        for model in ("resnet18-real", "smallcnn"):
            jobs.append({"series": "compute", "tag": f"compute_{model}_4h_1g",
                         "argv": ["--model", model, "--ranks", "4", "--peers", COMPUTE,
                                  "--densities", DENSITIES, *few]})
    if "overlap" in series:   # real backward: the stages start there (overlap=True)
        # resnet18 (synthetic gradients, no backward): the stages all run in step(), so this
        # is what the stages cost over one exchange, with nothing to hide them behind.
        for model in ("resnet18-real", "smallcnn", "resnet18"):
            jobs.append({"series": "overlap", "tag": f"overlap_{model}_4h_1g",
                         "argv": ["--model", model, "--ranks", "4",
                                  "--pulls", "slim,overlap,forward",
                                  "--peers", "floor,hvd_slim-slim@0.01,hvd_slim-overlap@0.01,"
                                  "hvd_slim-forward@0.01", "--densities", "0.01", *few]})
    if "scaling" in series:
        for hosts in (2, 4, 8):
            jobs.append({"series": "scaling", "tag": f"scaling_cnn1m_{hosts}h_100m", "hosts": hosts,
                         "argv": ["--model", "cnn1m", "--ranks", str(hosts), "--rate", "100mbit",
                                  "--peers", SUBSET.replace("horovod,", ""),
                                  "--densities", DENSITIES, "--steps", str(steps)]})
    if "hosts" in series:   # 2 ranks per host: hierarchical=True against the flat exchange
        for rate, dense in (("100m", "floor,mpi-allreduce,"), ("10m", "floor,")):   # dense: 4 s a step at 10
            jobs.append({"series": "hosts", "tag": f"hosts_cnn1m_2hx2_{rate}",
                         "argv": ["--model", "cnn1m", "--ranks", "4", "--ranks-per-host", "2",
                                  "--rate", f"{rate}bit", "--pulls", "slim,hier,sharded",
                                  "--peers", f"{dense}hvd_slim-slim@0.01,hvd_slim-hier@0.01,"
                                             "hvd_slim-sharded@0.01",
                                  "--densities", "0.01", "--steps", str(steps)]})
    if "hetero" in series:
        for slow in (3, 0):
            rates = ",".join("250mbit" if h == slow else "1gbit" for h in range(4))
            jobs.append({"series": "hetero", "tag": f"hetero_resnet18_slow{slow}", "slow": slow,
                         "argv": ["--model", "resnet18", "--ranks", "4", "--host-rates", rates,
                                  "--peers", SUBSET, "--densities", DENSITIES, *few]})
    if "shared" in series:
        jobs.append({"series": "shared", "tag": "shared_resnet18_4r_1g",
                     "argv": ["--model", "resnet18", "--ranks", "4", "--net", "shared",
                              "--peers", "floor,mpi-allreduce,hvd_slim-slim@0.02,hvd_slim-slim@0.01",
                              "--densities", DENSITIES, *few]})
    if "calibrate" in series:
        jobs.append({"series": "calibrate", "tag": "calibrate_resnet18_4r_loopback",
                     "argv": ["--model", "resnet18", "--ranks", "4", "--net", "loopback",
                              "--steps", str(steps), "--densities", DENSITIES,
                              "--pulls", PULLS]})
        # The hosts series' local work: its 4 ranks named 2 hosts by HVD_SLIM_HOST_KEY.
        jobs.append({"series": "calibrate", "tag": "calibrate_cnn1m_2hx2_loopback",
                     "argv": ["--model", "cnn1m", "--ranks", "4", "--ranks-per-host", "2",
                              "--net", "loopback", "--pulls", "slim,hier,sharded", "--peers",
                              "floor,mpi-allreduce,hvd_slim-slim@0.01,hvd_slim-hier@0.01,"
                              "hvd_slim-sharded@0.01",
                              "--densities", "0.01", "--steps", str(steps)]})
        for model in ("resnet18-real", "smallcnn"):   # the compute series' local work
            jobs.append({"series": "calibrate", "tag": f"calibrate_{model}_4r_loopback",
                         "argv": ["--model", model, "--ranks", "4", "--net", "loopback",
                                  "--peers", COMPUTE, "--densities", DENSITIES, *few]})
        for hosts in (2, 4, 8):
            jobs.append({"series": "calibrate", "tag": f"calibrate_cnn1m_{hosts}r_loopback",
                         "argv": ["--model", "cnn1m", "--ranks", str(hosts), "--net", "loopback",
                                  "--peers", SUBSET.replace("horovod,", ""),
                                  "--densities", DENSITIES, "--steps", str(steps)]})
    return jobs


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cluster_study",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--series", default=",".join(SERIES),
                    help=f"comma-separated subset of {', '.join(SERIES)}")
    ap.add_argument("--steps", type=int, default=12, help="measured steps per peer")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "cluster"))
    ap.add_argument("--only", default="",
                    help="comma-separated job tags (e.g. compute_smallcnn_4h_1g): run only "
                         "these of the chosen series")
    ap.add_argument("--quiet-cpu", default="0.5", help="passed to benchmarks.run")
    ap.add_argument("--summary-only", action="store_true",
                    help="rebuild summary.md and the plots from the JSON files in --out")
    args, extra = ap.parse_known_args(argv)
    series = [s for s in args.series.split(",") if s]
    bad = [s for s in series if s not in SERIES]
    if bad:
        ap.error(f"unknown series {bad}; choose from {', '.join(SERIES)}")
    jobs = plan(series, args.steps)
    only = [t for t in args.only.split(",") if t]
    unknown = sorted(set(only) - {j["tag"] for j in jobs})
    if unknown:
        ap.error(f"--only: no job tagged {', '.join(unknown)} in series {args.series}; "
                 f"the tags are {', '.join(j['tag'] for j in jobs)}")
    if only:
        jobs = [j for j in jobs if j["tag"] in only]
    failed = []
    if not args.summary_only:
        for job in jobs:
            argv_ = [*job["argv"], "--out", args.out, "--tag", job["tag"],
                     "--quiet-cpu", args.quiet_cpu, *extra]
            print(f"[cluster_study] {job['series']}: python -m benchmarks.run "
                  f"{' '.join(argv_)}", file=sys.stderr, flush=True)
            if run.main(argv_) != 0:
                failed.append(job["tag"])
    results = {}
    for job in plan(list(SERIES), args.steps):
        path = os.path.join(args.out, f"{job['tag']}.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                results[job["tag"]] = dict(json.load(f), study=job)
    print(summarise(results, args.out))
    if failed:
        print(f"[cluster_study] jobs with failed peers: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
