"""One rank of a benchmark job, run under ``mpirun`` by :mod:`benchmarks.run`.

    mpirun -np 4 python -m benchmarks.worker --model resnet18 --peers floor,mpi-allreduce --out f

For each peer in turn: a fresh workload (same parameters on every rank, per-rank seeded
gradients), warm-up steps, then measured steps. Each step starts after a barrier, so it is timed
from a common start; a step's time is the slowest rank's. Rank 0 appends one JSON line per peer to
``--out`` as soon as that peer finishes, so a later failure does not lose earlier results.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
import traceback
from typing import Any, Dict, List

import numpy as np
import torch
from mpi4py import MPI

from .models import Workload
from .peers import DenseAllreduce, Floor, Peer, Slim, TopKAllgather
from .ready import ReadyClock, profile


def make_peer(name: str, work: Workload, comm: Any, warmup: int) -> Peer:
    """The peer called ``name`` (see :func:`benchmarks.run.peer_names`)."""
    if name == "floor":
        return Floor(work, comm)
    if name == "mpi-allreduce":
        return DenseAllreduce(work, comm)
    if name.startswith("topk-ef@"):
        return TopKAllgather(work, comm, float(name.split("@")[1]))
    if name.startswith("hvd_slim-"):
        pull, density = name[len("hvd_slim-"):].split("@")
        return Slim(work, comm, float(density), pull)
    if name.startswith("ddp-"):
        from .peers_fw import Ddp
        return Ddp(work, comm, name[len("ddp-"):], warmup)
    if name in ("horovod", "horovod-fp16"):
        from .peers_fw import Horovod
        return Horovod(work, comm, fp16=name.endswith("fp16"))
    raise ValueError(f"unknown peer {name!r}")


def pingpong(comm: Any, mib: int, reps: int = 4) -> Dict[str, float]:
    """Ranks 0 and 1 bounce a ``mib`` MiB message: the bandwidth the job actually gets."""
    rank = comm.Get_rank()
    buf = np.zeros(mib << 20, dtype=np.uint8)
    comm.Barrier()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        if rank == 0:
            comm.Send(buf, dest=1)
            comm.Recv(buf, source=1)
        elif rank == 1:
            comm.Recv(buf, source=0)
            comm.Send(buf, dest=0)
        best = min(best, time.perf_counter() - t0)
    comm.Barrier()
    return {"message_mib": mib, "best_round_trip_s": best,
            "gbit_per_s": 2 * buf.nbytes * 8 / best / 1e9}


def nic_bytes() -> Dict[str, float]:
    """What this rank's host NIC (``HVDSLIM_BENCH_NIC``, on a switched cluster) has sent and
    received so far, from the kernel's counters; {} elsewhere."""
    nic = os.environ.get("HVDSLIM_BENCH_NIC")
    if not nic:
        return {}
    out = {}
    for key in ("tx", "rx"):
        with open(f"/sys/class/net/{nic}/statistics/{key}_bytes", encoding="ascii") as f:
            out[f"nic_{key}"] = float(f.read())
    return out


def _numeric(d: Dict[str, Any]) -> Dict[str, float]:
    return {k: float(v) for k, v in d.items() if isinstance(v, (int, float))}


def _local_size() -> Any:
    """hvd_slim's ``local_size()`` where a peer started hvd_slim (None elsewhere): on the
    switched cluster it shows that ``HVD_SLIM_HOST_KEY`` made it the ranks per host."""
    import hvd_slim
    return hvd_slim.local_size() if hvd_slim.is_initialized() else None


def run_peer(name: str, args: argparse.Namespace, comm: Any) -> Dict[str, Any]:
    """Warm up and measure one peer; every rank returns, rank 0's return value is the record."""
    rank = comm.Get_rank()
    work = Workload(args.model, rank, seed=args.seed)
    peer = make_peer(name, work, comm, args.warmup)
    warm = args.warmup + getattr(peer, "extra_warmup", 0)
    # The floor of a real backward times each gradient's readiness (benchmarks.ready).
    clock = ReadyClock(work.named) if name == "floor" and work.real else None
    load0 = os.getloadavg()
    times: List[float] = []
    phases: List[Dict[str, float]] = []   # hvd_slim's phase seconds of each measured step
    c0: Dict[str, float] = {}
    before = peer.phases()   # then each step's end is the next one's start
    for i in range(warm + args.steps):
        comm.Barrier()
        if i == warm:
            c0 = {**_numeric(peer.counters()), **nic_bytes()}
        t0 = time.perf_counter()
        peer.zero_grad()
        work.backward(i, peer.module)
        t_back = time.perf_counter()
        peer.step()
        dt = time.perf_counter() - t0
        after = peer.phases()
        if i >= warm:
            times.append(dt)
            phases.append({k: v - before[k] for k, v in after.items()})
            if clock is not None:
                clock.mark(t0, t_back)
        before = after
    c1 = {**_numeric(peer.counters()), **nic_bytes()}
    per_step = {k: (v - c0.get(k, 0.0)) / args.steps for k, v in c1.items()}
    extra = peer.extra() if hasattr(peer, "extra") else {}
    basis = dict(peer.basis)
    all_times = comm.gather(times, root=0)
    all_phases = comm.gather(phases, root=0)
    all_counts = comm.gather(per_step, root=0)
    all_extra = comm.gather(extra, root=0)
    all_hosts = comm.gather(os.environ.get("HVDSLIM_BENCH_HOST"), root=0)   # switched cluster
    local = comm.gather(_local_size(), root=0)
    ready = comm.gather(clock.steps if clock is not None else None, root=0)
    if clock is not None:
        clock.close()
    peer.close()
    del peer, work
    gc.collect()
    if rank != 0:
        return {}
    step_times = [max(ts[i] for ts in all_times) for i in range(args.steps)]
    more = {"backward_profile": profile(ready, clock.names, clock.numel)} if clock else {}
    return {**more, "peer": name, "status": "ok", "step_times_s": step_times,
            "rank_step_times_s": all_times, "per_rank_per_step": all_counts,
            **({"rank_phase_steps_s": all_phases} if phases and phases[0] else {}),
            "extra": all_extra, "basis": basis, "warmup_steps": warm, "measured_steps": args.steps,
            "hosts": all_hosts, "local_size": local,
            "loadavg_before": load0, "loadavg_after": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description="one rank of a benchmark job (run under mpirun)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--peers", required=True, help="comma-separated peer names")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pingpong-mib", type=int, default=0)
    ap.add_argument("--out", required=True, help="JSON-lines file rank 0 appends to")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()

    def emit(rec: Dict[str, Any]) -> None:
        if rank == 0:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")

    if args.pingpong_mib and comm.Get_size() > 1:
        emit({"pingpong": pingpong(comm, args.pingpong_mib)})
    for name in args.peers.split(","):
        try:
            emit(run_peer(name, args, comm))
        except Exception as exc:  # noqa: BLE001 - record it; a one-sided failure hits the timeout
            emit({"peer": name, "status": "failed", "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-3000:]})
            gc.collect()
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
