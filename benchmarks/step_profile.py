"""Where one rank's exchange time goes, with no network: simulated ranks over the in-process
transport, one thread each, one of them profiled with cProfile.

    python -m benchmarks.step_profile --model resnet18 --density 0.01 --steps 10
    python -m benchmarks.step_profile --model resnet18 --density 0.02 --ranks 2 --profile-rank 1

With one rank (the default) it does both roles, worker and server, so its own pull comes back
from the memo of what it encoded (wire/recent.py) and is never decoded. A worker of several
ranks (``--profile-rank 1``) decodes every pull, as on a cluster; its time waiting for the others
shows as ``_wait`` (the in-process transport's barrier).

Prints the mean step time and the functions with the most own time per step.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import hvd_slim
from hvd_slim.transport import run_ranks

from .models import Workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=20, help="functions to list")
    ap.add_argument("--ranks", type=int, default=1, help="simulated ranks (rank 0 serves)")
    ap.add_argument("--profile-rank", type=int, default=0, help="the rank profiled")
    ap.add_argument("--sort", choices=("own", "cum"), default="own",
                    help="list by own time, or by cumulative time (what a call and its callees "
                         "take)")
    args = ap.parse_args()
    if not 0 <= args.profile_rank < args.ranks:
        ap.error(f"--profile-rank {args.profile_rank} is not a rank of --ranks {args.ranks}")
    torch.set_num_threads(1)

    def body(rank: int, transport: object) -> None:
        work = Workload(args.model, rank)
        inner = torch.optim.SGD([p for _, p in work.named], lr=0.01, momentum=0.9)
        opt = hvd_slim.DistributedOptimizer(inner, named_parameters=work.named,
                                            density=args.density, transport=transport)
        mine = rank == args.profile_rank
        for i in range(args.warmup + args.steps):
            if i == args.warmup and mine:
                prof, start = cProfile.Profile(), time.perf_counter()
                prof.enable()
            opt.zero_grad()
            work.backward(i, work.model)
            opt.step()
        if not mine:
            return
        prof.disable()
        per_step = (time.perf_counter() - start) / args.steps
        print(f"{args.model}, density {args.density:g}, rank {rank} of {args.ranks}, a thread "
              f"each: "
              f"{per_step * 1e3:.1f} ms per step (backward + exchange + optimizer step), "
              f"{args.steps} steps under cProfile; {args.sort} time per step:")
        stats = pstats.Stats(prof)
        col = 2 if args.sort == "own" else 3
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][col])[:args.top]
        for (path, line, name), (_, calls, own, cum, _) in rows:
            where = f"{path.rsplit('/', 2)[-1]}:{line}" if line else "(builtin)"
            print(f"  {own / args.steps * 1e3:7.2f} ms own  {cum / args.steps * 1e3:7.2f} ms cum  "
                  f"{calls // args.steps:5d} calls  {name}  {where}")

    run_ranks(args.ranks, body, timeout=600)


if __name__ == "__main__":
    main()
