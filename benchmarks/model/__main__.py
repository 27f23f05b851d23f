"""``python -m benchmarks.model {validate,extrapolate,predict} ...`` (see --help)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from . import extrapolate, validate
from . import net as nw
from .slim import SlimSettings
from .scenario import ALLREDUCE, MPI_KINDS, LocalCosts, Scenario
from .strategies import predict
from .workloads import WORKLOADS, shapes_of


def _floats(text: str) -> List[float]:
    return [float(x) for x in text.split(",") if x]


def _local(a: argparse.Namespace) -> LocalCosts:
    return LocalCosts(pass_s=a.pass_ns * 1e-9, scatter_s=None if a.scatter_ns is None
                      else a.scatter_ns * 1e-9, topk_select_s=a.topk_select_ns * 1e-9,
                      slim_select_s=a.slim_select_ns * 1e-9)


def _add_costs(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("local work (default 0: communication only)")
    g.add_argument("--compute-s", type=float, default=0.0, help="compute seconds per step")
    g.add_argument("--pass-ns", type=float, default=0.0,
                   help="ns per element of one streaming pass over the gradient")
    g.add_argument("--scatter-ns", type=float, default=None,
                   help="ns per indexed read/add (default: --pass-ns)")
    g.add_argument("--topk-select-ns", type=float, default=0.0,
                   help="ns per element of torch.topk (top-k peers)")
    g.add_argument("--slim-select-ns", type=float, default=0.0,
                   help="ns per element of hvd_slim's selection (worker and server)")
    p.add_argument("--latency-us", type=float, default=extrapolate.LATENCY_S * 1e6)
    p.add_argument("--overhead-us", type=float, default=0.0, help="software cost per message")
    p.add_argument("--allreduce", choices=sorted(ALLREDUCE), default="ring",
                   help="an ideal MPI's allreduce (the dense baseline; default ring)")
    p.add_argument("--mpi", choices=MPI_KINDS, default="ideal",
                   help="ideal: full duplex, --allreduce; openmpi-tcp: Open MPI 4.1's own "
                        "algorithms over its TCP BTL, as the benchmark runs them")
    p.add_argument("--value-bits", type=int, choices=(8, 16, 32), default=8,
                   help="hvd_slim's value_bits")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.model",
                                 description="analytic cost model of one data-parallel step")
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="predictions against benchmark results JSON files")
    v.add_argument("results", nargs="+", help="benchmarks/results/<tag>.json")
    v.add_argument("--tolerance", type=float, default=0.25,
                   help="largest |predicted/measured - 1| that passes (default 0.25)")
    v.add_argument("--local-from", nargs="+", action="extend", metavar="CALIB.json",
                   default=None,
                   help="calibration runs (the same peers on the loopback): each results file "
                        "takes the one with its model and rank count, and every peer's "
                        "compute + local work is that run's median minus the model's "
                        "communication there, times the file's load index (exit 2 when a "
                        "file has none)")
    v.add_argument("--no-load-correction", action="store_true",
                   help="with --local-from: do not scale the calibrated local work by the "
                        "load index (the median ratio of the two runs' selection times)")
    e = sub.add_parser("extrapolate", help="tables and plots for N = 16 .. 1024 hosts")
    e.add_argument("--out", required=True, help="directory for extrapolation.md and PNGs")
    e.add_argument("--models", default=",".join(extrapolate.DEFAULT_MODELS))
    e.add_argument("--rates-gbit", default=",".join(f"{r:g}" for r in extrapolate.DEFAULT_RATES))
    e.add_argument("--ranks", default=",".join(map(str, extrapolate.DEFAULT_RANKS)))
    e.add_argument("--peers", default=",".join(extrapolate.DEFAULT_PEERS))
    e.add_argument("--slow-host", type=float, default=None, metavar="FRACTION",
                   help="the last host's NIC at this fraction of the rate")
    e.add_argument("--local-from", metavar="RESULTS.json", default=None,
                   help="take the per-element local costs (pass, selections) measured in a "
                        "benchmark results file instead of the --*-ns options")
    _add_costs(e)
    p = sub.add_parser("predict", help="one peer's prediction, part by part")
    p.add_argument("peer", help='a benchmark peer name, e.g. "hvd_slim-slim@0.01"')
    p.add_argument("--model", choices=sorted(WORKLOADS), default="resnet50")
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--topology", choices=nw.TOPOLOGIES, default="switched")
    p.add_argument("--rate-gbit", default="10", help="one rate, or one per host (comma list)")
    p.add_argument("--ranks-per-host", type=int, default=1)
    _add_costs(p)
    return ap.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    a = parse_args(argv)
    if a.cmd == "validate":
        return validate.main(a.results, a.tolerance, a.local_from,
                             corrected=not a.no_load_correction)
    slim = SlimSettings(value_bits=a.value_bits)
    if a.cmd == "extrapolate":
        local = _local(a)
        if a.local_from:
            with open(a.local_from, encoding="utf-8") as f:
                local = validate.local_costs_of(json.load(f))
        return extrapolate.main(
            a.out, [m for m in a.models.split(",") if m], _floats(a.rates_gbit),
            [int(x) for x in a.ranks.split(",") if x], [p for p in a.peers.split(",") if p],
            latency_s=a.latency_us * 1e-6, overhead_s=a.overhead_us * 1e-6,
            compute_s=a.compute_s, local=local, slim=slim, allreduce=a.allreduce, mpi=a.mpi,
            slow_host=a.slow_host)
    net = nw.Network(a.topology, tuple(r * 1e9 for r in _floats(a.rate_gbit)),
                     latency_s=a.latency_us * 1e-6, overhead_s=a.overhead_us * 1e-6,
                     ranks_per_host=a.ranks_per_host)
    sc = Scenario(a.ranks, net, tuple(shapes_of(a.model)), compute_s=a.compute_s,
                  local=_local(a), slim=slim, allreduce=a.allreduce, mpi=a.mpi)
    pr = predict(a.peer, sc)
    print(f"{pr.peer}: {pr.seconds:.6g} s/step = compute {pr.compute_s:.4g} + local "
          f"{pr.local_s:.4g} + communication {pr.comm_s:.4g}; busiest NIC tx "
          f"{pr.busiest_tx / 1e6:.4g} MB, rx {pr.busiest_rx / 1e6:.4g} MB per step")
    for k, v in pr.detail.items():
        print(f"  {k}: {v:.6g}" if isinstance(v, float) else f"  {k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
