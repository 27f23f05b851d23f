"""Side-by-side benchmark: hvd_slim against dense allreduce, Horovod, DDP hooks and top-k.

    python -m benchmarks.run                      # ResNet-18 shapes, 4 hosts, 1 Gbit/s (root)
    python -m benchmarks.run --net loopback --ranks 2 --model tiny --steps 3   # quick, no root

Each peer runs as its own ``mpirun`` job (``--no-isolate``: all in one job) on an emulated
network, removed afterwards, also on failure or SIGTERM:

* ``--net switched`` (default): a switched cluster, one network namespace per host with its own
  NIC at ``--rate`` into one switch (benchmarks/cluster.py); ``--hosts``, ``--ranks-per-host``,
  ``--host-rates`` (heterogeneous links) and ``--latency-ms`` shape it. Each host's NIC bytes
  are counted.
* ``--net shared``: every rank in one namespace whose loopback is limited to ``--rate``, so all
  ranks share one link (``tbf1g``/``tbf10g``: the same at 1 and 10 Gbit/s).
* ``--net loopback``: no shaping, no privileges.

Results go to ``--out`` (default benchmarks/results/): ``<tag>.json`` (every raw figure, the
command line, the machine, the topology), ``<tag>.md`` (the table) and ``<tag>_*.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from . import cluster, launch, netem, report
from .machine import describe, horovod_status, wait_for_quiet
from .models import MODELS

NETS = ("switched", "shared", *sorted(netem.NETS))


def peer_names(densities: List[float], pulls: List[str]) -> List[str]:
    """Every peer, in run order: cheap ones first so a failure shows up early. (Here, not in
    benchmarks.peers: importing that imports mpi4py.MPI, which initialises MPI, and a launcher
    that is an MPI singleton hands its variables to the mpirun it starts.)"""
    names = ["floor", "mpi-allreduce", "horovod", "horovod-fp16", "ddp-allreduce", "ddp-fp16",
             "ddp-powersgd-r1", "ddp-powersgd-r4", "ddp-slim", "ddp-slim-1b", "ddp-slim-1bv",
             "ddp-local4"]
    names += [f"topk-ef@{d:g}" for d in densities]
    names += [f"hvd_slim-{p}@{d:g}" for d in densities for p in pulls]
    return names

def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--model", choices=MODELS, default="resnet18",
                    help="parameter shapes with synthetic gradients, or smallcnn "
                         "(real forward and backward passes)")
    ap.add_argument("--densities", default="0.1,0.01,0.001",
                    help="densities for hvd_slim and the top-k baseline")
    ap.add_argument("--pulls", default="slim,union", help="hvd_slim pull modes: slim, union, "
                    "sharded (slim with a server shard per rank), hier (slim with "
                    "hierarchical=True), overlap (slim with overlap=True), forward (overlap with "
                    "overlap_forward=True), warm (slim with the automatic warm-up on)")
    ap.add_argument("--net", choices=NETS, default="switched",
                    help="switched: one NIC per host into a switch; shared: one link for all "
                         "ranks (tbf1g/tbf10g at 1/10 Gbit/s); loopback: unshaped, no root")
    ap.add_argument("--rate", default="1gbit", help="NIC rate (switched) or link rate (shared)")
    ap.add_argument("--hosts", type=int, default=0,
                    help="hosts of the switched cluster (default ranks / ranks-per-host)")
    ap.add_argument("--ranks-per-host", type=int, default=1,
                    help="ranks in each host namespace (switched); elsewhere only the hosts "
                         "named by HVD_SLIM_HOST_KEY, for hierarchical=True")
    ap.add_argument("--host-rates", default="", help="comma-separated rate per host, e.g. "
                    "1gbit,1gbit,1gbit,250mbit (switched)")
    ap.add_argument("--latency-ms", type=float, default=0.0,
                    help="one-way latency added between hosts (switched; needs sch_netem)")
    ap.add_argument("--steps", type=int, default=20, help="measured steps per peer and repeat")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=1, help="run every peer this many times, "
                    "interleaved, and pool the measured steps")
    ap.add_argument("--peers", default="", help="comma-separated subset (names or prefixes)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pingpong-mib", type=int, default=16, help="calibrate the link (0: skip)")
    ap.add_argument("--no-isolate", dest="isolate", action="store_false",
                    help="run every peer in one mpirun job (faster; a crash takes all down)")
    ap.add_argument("--quiet-cpu", type=float, default=0.0, metavar="FRACTION",
                    help="before each job wait until other processes keep less than this "
                         "fraction of the CPUs busy (0: do not wait); for shared machines")
    ap.add_argument("--max-wait", type=float, default=300, help="seconds to wait for quiet")
    ap.add_argument("--timeout", type=float, default=0, help="seconds per job (0: estimate)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--tag", default="", help="output file prefix (default model_ranks_net)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment variable for every rank (e.g. HVD_SLIM_EXPLORATION=0); "
                         "repeatable, recorded in the JSON")
    ap.add_argument("--profile", default="", metavar="DIR",
                    help="record every rank with py-spy (raw collapsed stacks) into DIR; "
                         "summarise with python -m benchmarks.profile_summary DIR")
    args = ap.parse_args(argv)
    args.density_list = [float(x) for x in args.densities.split(",") if x]
    args.pull_list = [x for x in args.pulls.split(",") if x]
    bad = [kv for kv in args.env if "=" not in kv or not kv.split("=", 1)[0]]
    if bad:
        ap.error(f"--env takes KEY=VALUE, got {bad}")
    if args.net == "switched":
        args.hosts = args.hosts or max(1, args.ranks // args.ranks_per_host)
        if args.hosts * args.ranks_per_host != args.ranks:
            ap.error(f"--ranks {args.ranks} must equal --hosts {args.hosts} x --ranks-per-host "
                     f"{args.ranks_per_host}")
        try:
            args.spec = cluster.ClusterSpec(args.hosts, args.rate, args.ranks_per_host,
                                            tuple(x for x in args.host_rates.split(",") if x),
                                            args.latency_ms)
        except ValueError as exc:
            ap.error(str(exc))
    elif args.host_rates or args.latency_ms or args.hosts:
        ap.error("--hosts, --host-rates and --latency-ms need --net switched")
    elif args.ranks % args.ranks_per_host:
        ap.error(f"--ranks {args.ranks} must be a multiple of --ranks-per-host "
                 f"{args.ranks_per_host}")
    args.link_gbit = {"tbf1g": 1.0, "tbf10g": 10.0, "loopback": 20.0}.get(
        args.net, cluster.rate_bps(args.rate) / 1e9)
    net = {"switched": f"sw{args.rate}", "shared": f"shared{args.rate}"}.get(args.net, args.net)
    args.tag = args.tag or f"{args.model}_{args.ranks}r_{net}"
    return args


def selected(args: argparse.Namespace) -> List[str]:
    """The peers to run: every one of ``--densities`` x ``--pulls``, or those ``--peers`` names
    (an hvd_slim pull mode named there need not be in ``--pulls``); a name that matches no peer
    is an error, never silently dropped."""
    want = [w for w in args.peers.split(",") if w]
    pulls = list(args.pull_list)
    for w in want:
        m = re.match(r"hvd_slim-(\w+)@", w)
        if m and m[1] not in pulls:
            pulls.append(m[1])
    names = peer_names(args.density_list, pulls)
    if not want:
        return names
    unknown = [w for w in want if not any(n == w or n.startswith(w) for n in names)]
    if unknown:
        raise SystemExit(f"benchmarks.run: --peers names no peer for {unknown} (with "
                         f"--densities {args.densities}); the peers are {', '.join(names)}")
    return [n for n in names if any(n == w or n.startswith(w) for w in want)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mpirun_argv(args: argparse.Namespace, peers: List[str], out: str, port: int,
                pingpong: int, net: Any = None) -> List[str]:
    """Open MPI's TCP transport only, on every network: shared memory would bypass the shaping,
    and the loopback runs stay comparable with the shaped ones. Over ``lo`` (netem.MPI_ARGS),
    or on a switched cluster (``net``) over each host's eth0, each rank entering its host. The
    whole command line: mpirun starts inside the shared namespace or the launcher's."""
    switched = isinstance(net, cluster.Cluster)
    prefix = net.mpirun_prefix() if switched else netem.wrap(net, [])
    return [*prefix, "mpirun", "-np", str(args.ranks), "--oversubscribe", "--bind-to", "none",
            *(cluster.MPI_ARGS if switched else netem.MPI_ARGS),
            # Ranks waiting in MPI yield the core to ranks still computing (4 ranks, 2 cores).
            "--mca", "mpi_yield_when_idle", "1",
            "-x", f"HVDSLIM_BENCH_PORT={port}", "-x", "OMP_NUM_THREADS", "-x", "GLOO_SOCKET_IFNAME",
            *[a for k in (net.env() if switched else {}) for a in ("-x", k)],
            *[a for kv in args.env for a in ("-x", kv)], *_profiler(args, peers),
            *(net.rank_prefix() if switched else _host_key_prefix(args.ranks_per_host)),
            sys.executable, "-m", "benchmarks.worker", "--model", args.model,
            "--peers", ",".join(peers), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--threads", str(args.threads), "--seed", str(args.seed),
            "--pingpong-mib", str(pingpong), "--out", out]


def _host_key_prefix(per_host: int) -> List[str]:
    """Without host namespaces, ``--ranks-per-host`` names the hosts by HVD_SLIM_HOST_KEY only
    (ranks r*k .. r*k+k-1 are host r), so that ``hierarchical=True`` sees them (a calibration
    of the switched runs' local work on the loopback)."""
    if per_host == 1:
        return []
    script = (f'HVD_SLIM_HOST_KEY=host$((OMPI_COMM_WORLD_RANK / {per_host})); '
              'export HVD_SLIM_HOST_KEY; exec "$@"')
    return ["sh", "-c", script, "sh"]


def _profiler(args: argparse.Namespace, peers: List[str]) -> List[str]:
    """A py-spy prefix that names each rank's output after the peer and the MPI rank."""
    if not args.profile:
        return []
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        spy = shutil.which("py-spy") or "py-spy"
    os.makedirs(args.profile, exist_ok=True)
    prefix = os.path.join(os.path.abspath(args.profile), "+".join(peers))
    # --idle keeps samples of ranks blocked in MPI, so shares are of wall time.
    script = (f'p=$1; shift; exec {shlex.quote(spy)} record --nonblocking --idle -r 100 -f raw '
              f'-o "$p.rank$OMPI_COMM_WORLD_RANK.txt" -- "$@"')
    return ["sh", "-c", script, "sh", prefix]


def job_timeout(args: argparse.Namespace, n_peers: int, numel: int) -> float:
    """Generous: four times a dense ring allreduce's link time per step, plus start-up."""
    if args.timeout:
        return args.timeout
    link_bytes = 2 * (args.ranks - 1) * numel * 4
    dense_s = link_bytes * 8 / (args.link_gbit * 1e9) + 0.05 * args.ranks
    return n_peers * (90 + 4 * (args.warmup + args.steps + 2) * dense_s)


def run_job(argv: List[str], net: Any, timeout: float, out: str
            ) -> Dict[str, Any]:
    """Run one mpirun job in a session of its own (benchmarks/launch.py); on timeout that
    session is killed whole and the job reported as timed out."""
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if isinstance(net, cluster.Cluster):
        env.update(net.env())
    try:
        returncode, text, _ = launch.run_session(argv, timeout, env)
        status = f"exit {returncode}"
    except launch.MpiTimeout as exc:
        returncode, text, status = None, exc.output, f"timed out after {timeout:.0f} s"
    records = []
    if os.path.exists(out):
        with open(out, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    return {"status": status, "returncode": returncode, "records": records,
            "output_tail": (text or "")[-4000:]}


def _network(args: argparse.Namespace) -> Any:
    """The network the jobs run on: a Cluster, a shared namespace's name, or None."""
    if args.net == "switched":
        return cluster.switched(args.spec)
    if args.net == "shared":
        return netem.namespace("shared", args.rate)
    return netem.namespace(args.net)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    from .models import Workload
    numel = Workload.numel_of(args.model)
    peers = selected(args)
    hvd_missing = horovod_status()
    runnable = [p for p in peers if not (p.startswith("horovod") and hvd_missing)]
    meta: Dict[str, Any] = {"command": shlex.join([sys.executable, "-m", "benchmarks.run",
                                                   *(sys.argv[1:] if argv is None else argv)]),
                            "settings": {k: v for k, v in vars(args).items() if k != "spec"},
                            "machine": describe(), "horovod": hvd_missing or "installed",
                            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                            "loadavg_start": os.getloadavg(), "jobs": []}
    jobs = [[p] for p in runnable] if args.isolate else [runnable]
    records: List[Dict[str, Any]] = []
    tmp = tempfile.mkdtemp(prefix="hvdslim-bench-")
    try:
        with _network(args) as ns:
            meta["network"] = ns.describe() if isinstance(ns, cluster.Cluster) else {
                "mode": "loopback" if args.net == "loopback" else "shared", "net": args.net,
                "rate_gbit": [args.link_gbit], "namespace": ns, "qdisc": netem.qdisc(ns),
                "host_key_ranks_per_host": args.ranks_per_host}
            for rep in range(args.repeats):
                for j, job in enumerate(jobs):
                    out = os.path.join(tmp, f"r{rep}_j{j}.jsonl")
                    pp = args.pingpong_mib if rep == 0 and j == 0 else 0
                    argv_ = mpirun_argv(args, job, out, free_port(), pp, ns)
                    quiet = wait_for_quiet(args.quiet_cpu, args.max_wait)
                    print(f"[bench] repeat {rep + 1}/{args.repeats}: {', '.join(job)} (others "
                          f"busy {quiet['cpu_busy_before']:.0%} of the CPUs, load "
                          f"{quiet['loadavg_1m']:.2f})", file=sys.stderr, flush=True)
                    res = run_job(argv_, ns, job_timeout(args, len(job), numel), out)
                    meta["jobs"].append({"peers": job, "repeat": rep, "status": res["status"],
                                         "argv": argv_, **quiet})
                    got = {r.get("peer") for r in res["records"]}
                    for r in res["records"]:
                        if "pingpong" in r:
                            meta["network"]["pingpong"] = r["pingpong"]
                        else:
                            records.append(dict(r, repeat=rep))
                    for p in job:
                        if p not in got:
                            records.append({"peer": p, "repeat": rep, "status": "failed",
                                            "error": f"job {res['status']} before reporting",
                                            "output_tail": res["output_tail"]})
    except netem.NetemError as exc:
        print(f"benchmarks.run: {exc}", file=sys.stderr)
        return 2
    finally:
        for f in os.listdir(tmp):
            os.remove(os.path.join(tmp, f))
        os.rmdir(tmp)
    meta["loadavg_end"] = os.getloadavg()
    for p in peers:
        if p not in runnable:
            records.append({"peer": p, "status": "not installed",
                            "error": f"import horovod.torch failed: {hvd_missing}"})
    results = report.build(meta, records, peers, args)
    paths = report.write(results, args.out, args.tag)
    print(report.markdown(results))
    print("\n".join(f"[bench] wrote {p}" for p in paths), file=sys.stderr)
    failed = [n for n, r in results["peers"].items() if r["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
