"""Soak benchmark (issue 6): many Slim-DP steps at a low density, checking as it goes that

* the exchange's memory (residuals, velocities, buffers, cores, the server's state) stays
  exactly constant in size,
* every replica's parameters hash the same,
* the process's resident memory (RSS) grows by no more than ``--rss-tolerance`` (5%) after
  warm-up (hvd_slim's own, whose slices shrink step by step, and a few more steps).

Full run: ``mpirun -np 3 python tests/scripts/soak.py --steps 2000 --density 0.001``.
The suite runs a short version (tests/unit/test_reliability_launch.py). Each rank prints one
``soak: rank R ...`` JSON line; any failed check raises (and so aborts the whole job).
"""
import argparse
import hashlib
import json
import os
import sys
import time

import torch

import hvd_slim as hvd


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def exchange_bytes(opt) -> int:
    """Bytes of every tensor the exchange holds between steps."""
    ex = opt._exchange
    worker = ex.worker
    tensors = [t for m in worker.memory.values()
               for t in (m.residual, m.velocity, m._next_velocity) if t is not None]
    tensors += list(worker._flat.values()) + list(worker._score.values())
    if ex.server is not None:
        tensors += [m.residual for m in ex.server.memory.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def params_hash(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--check-every", type=int, default=100)
    ap.add_argument("--rss-tolerance", type=float, default=0.05)
    ap.add_argument("--warmup-decay-steps", type=int, default=None,
                    help="hvd_slim's warm-up (default automatic: 1/density steps)")
    args = ap.parse_args()

    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   density=args.density,
                                   warmup_decay_steps=args.warmup_decay_steps)
    # Memory is measured from a little after the warm-up: its slices shrink step by step.
    warm = min(args.steps, opt.slim_config.warmup_steps + max(1, min(args.steps // 10, 100)))
    mem0 = rss0 = None
    start = time.perf_counter()
    checks = 0
    for step in range(args.steps):
        g = torch.Generator().manual_seed(7919 * rank + step)
        x, y = torch.randn(32, 256, generator=g), torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step + 1 == warm:
            mem0, rss0 = exchange_bytes(opt), rss_bytes()
        if (step + 1) % args.check_every == 0 or step + 1 == args.steps:
            checks += 1
            hashes = hvd.allgather_object(params_hash(model))
            if len(set(hashes)) != 1:
                raise RuntimeError(f"soak: replicas differ after step {step}: {hashes}")
            if mem0 is not None and exchange_bytes(opt) != mem0:
                raise RuntimeError(f"soak: exchange memory changed from {mem0} to "
                                   f"{exchange_bytes(opt)} bytes at step {step}")
    rss1 = rss_bytes()
    growth = (rss1 - rss0) / rss0 if rss0 else 0.0
    stats = opt.comm_stats()
    line = {"rank": rank, "steps": stats["steps"], "seconds": round(time.perf_counter() - start, 1),
            "exchange_bytes": exchange_bytes(opt), "rss_warm_mb": round(rss0 / 2 ** 20, 1),
            "rss_end_mb": round(rss1 / 2 ** 20, 1), "rss_growth": round(growth, 4),
            "checks": checks, "pushed_per_step": stats["bytes_pushed"] // stats["steps"],
            "dense_per_step": stats["dense_bytes"] // stats["steps"]}
    sys.stdout.write(f"soak: rank {rank} {json.dumps(line)}\n")   # one write: one line
    sys.stdout.flush()
    if growth > args.rss_tolerance:
        raise RuntimeError(f"soak: RSS grew by {growth:.1%} (over {args.rss_tolerance:.0%}) from "
                           f"{rss0} to {rss1} bytes")
    hvd.barrier()
    if rank == 0:
        print(f"soak: OK, {args.steps} steps at {hvd.size()} ranks, density {args.density}",
              flush=True)


if __name__ == "__main__":
    main()
