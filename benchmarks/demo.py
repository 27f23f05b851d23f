"""``make demo``: examples/demo.py (dense against hvd_slim's defaults on real MNIST) where its step
times say what the bytes buy.

    python -m benchmarks.demo [--np 4] [--rate 1gbit] [-- DEMO FLAGS]

Run as root with network namespaces, each rank is a host of the emulated switched cluster
(benchmarks/cluster.py: one NIC per host at ``--rate``, one switch), so every step pays for its
bytes as on a real cluster. Elsewhere (not root, no ``ip``/``tc``, namespaces refused) it runs on
the loopback, where bytes cost almost nothing and only hvd_slim's own work shows, and prints a
line saying so. The cluster is torn down afterwards, also on failure.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from typing import List, Optional, Sequence

from . import cluster, netem
from .launch import mpirun_argv, run_session, session_env


def _demo(flags: Sequence[str], network: str) -> List[str]:
    return [sys.executable, "-m", "examples.demo", "--network", network, *flags]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=4, help="ranks (one host each on the cluster)")
    ap.add_argument("--rate", default="1gbit", help="each host's NIC rate on the cluster")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds before the job is killed")
    ap.add_argument("flags", nargs="*", help="examples/demo.py's flags, after --")
    args = ap.parse_args(argv)
    if args.np < 1:
        ap.error(f"--np must be at least 1, got {args.np}")
    spec = cluster.ClusterSpec(hosts=args.np, rate=args.rate)   # a bad --rate is an error
    env = dict(session_env(), OMP_NUM_THREADS="1")
    with contextlib.ExitStack() as stack:
        try:
            netem.check_privileges()
            c: Optional[cluster.Cluster] = stack.enter_context(cluster.switched(spec))
        except netem.NetemError as exc:
            c = None
            print(f"make demo: no switched cluster here ({exc}); running on the loopback, where "
                  "bytes cost almost nothing, so the times show hvd_slim's own work and not what "
                  "its bytes save", flush=True)
        if c is None:
            argv_ = mpirun_argv(args.np, _demo(args.flags, "loopback (one machine, no NIC)"),
                                export=("OMP_NUM_THREADS",))
            return run_session(argv_, args.timeout, env, capture=False)[0]
        rate = c.spec.rates()[0]
        argv_ = c.mpirun_argv(args.np, _demo(args.flags, f"switched cluster, {args.np} hosts "
                                             f"with one {rate} NIC each"), ("OMP_NUM_THREADS",))
        return run_session(argv_, args.timeout,
                           dict(env, **c.env()), capture=False)[0]


if __name__ == "__main__":
    sys.exit(main())
