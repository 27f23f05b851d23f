"""Where one rank's exchange time goes, with no network: a single rank doing both roles
(worker and server) on one thread over the in-process transport, profiled with cProfile.

    python -m benchmarks.step_profile --model resnet18 --density 0.01 --steps 10

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
    args = ap.parse_args()
    torch.set_num_threads(1)

    def body(rank: int, transport: object) -> None:
        work = Workload(args.model, rank)
        inner = torch.optim.SGD([p for _, p in work.named], lr=0.01, momentum=0.9)
        opt = hvd_slim.DistributedOptimizer(inner, named_parameters=work.named,
                                            density=args.density, transport=transport)
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                prof, start = cProfile.Profile(), time.perf_counter()
                prof.enable()
            opt.zero_grad()
            work.backward(i, work.model)
            opt.step()
        prof.disable()
        per_step = (time.perf_counter() - start) / args.steps
        print(f"{args.model}, density {args.density:g}, 1 rank on 1 thread: "
              f"{per_step * 1e3:.1f} ms per step (backward + exchange + optimizer step), "
              f"{args.steps} steps under cProfile; own time per step:")
        stats = pstats.Stats(prof)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:args.top]
        for (path, line, name), (_, calls, own, cum, _) in rows:
            where = f"{path.rsplit('/', 2)[-1]}:{line}" if line else "(builtin)"
            print(f"  {own / args.steps * 1e3:7.2f} ms own  {cum / args.steps * 1e3:7.2f} ms cum  "
                  f"{calls // args.steps:5d} calls  {name}  {where}")

    run_ranks(1, body, timeout=600)


if __name__ == "__main__":
    main()
