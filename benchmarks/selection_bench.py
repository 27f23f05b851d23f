"""Core-selection speed: significance + CoreSelector.select against torch.topk, on one thread.

    python -m benchmarks.selection_bench --numel 11700000 --density 0.01

"cold" is a fresh selector each call (threshold estimated from the sample); "warm" carries the
threshold over a sequence of similar vectors (a slowly drifting gradient, as between steps).
"explore" is one slice's exploration set around that core (``exploration`` of the slice,
keyed afresh each call as every push and pull is): a fixed cost that every piece of a sharded
exchange pays on each rank that sends or decodes it.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, List

import torch

from hvd_slim.selection import CoreSelector, significance
from hvd_slim.selection.explore import ROLE_PUSH, slice_indices


def _time(fn: Callable[[int], object], reps: int) -> List[float]:
    """Milliseconds of ``fn(i)`` for i in range(reps), after one untimed warm-up call."""
    fn(0)
    out = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    """Parse arguments, run the measurements, print one line per method."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=11_700_000)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--lam", type=float, default=0.0, help="magnitude weight in the significance")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--exploration", type=float, default=0.1, help="explored share of a slice")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n, k = args.numel, max(1, int(round(args.density * args.numel)))
    gen = torch.Generator().manual_seed(args.seed)
    # A drifting gradient: each step keeps 90% of the last and mixes in fresh noise, so the
    # k-th largest magnitude moves a little between steps, as it does in training.
    steps = [torch.randn(n, generator=gen)]
    for _ in range(args.reps):
        steps.append(0.95 * steps[-1] + 0.3 * torch.randn(n, generator=gen))
    w = torch.randn(n, generator=gen)
    out = torch.empty(n)

    def sig(i: int) -> torch.Tensor:
        return significance(steps[i % len(steps)], w, args.lam, out=out)

    warm_sel = CoreSelector()
    cold = _time(lambda i: CoreSelector().select(sig(i), k), args.reps)
    warm = _time(lambda i: warm_sel.select(sig(i), k), args.reps)
    sig_only = _time(sig, args.reps)
    topk = _time(lambda i: torch.topk(sig(i), k), max(3, args.reps // 3))
    k_e = int(round(args.exploration * k))
    core = warm_sel.select(sig(0), k - k_e)
    cpu = torch.device("cpu")
    explore_ms = _time(lambda i: slice_indices(n, core, k_e, seed=args.seed, role=ROLE_PUSH,
                                               rank=0, step=i, bucket=0, device=cpu),
                       max(100, args.reps))

    # Exactness spot check: the same set as torch.topk on the last vector.
    score = sig(args.reps).clone()
    mine = warm_sel.select(score, k)
    ref = torch.sort(torch.topk(score, k).indices).values
    exact = bool(torch.equal(mine, ref))

    med = statistics.median
    print(f"numel={n} k={k} lam={args.lam} threads={torch.get_num_threads()} "
          f"(median ms per call, significance included)")
    print(f"  significance alone        {med(sig_only):8.2f} ms")
    print(f"  select, cold threshold    {med(cold):8.2f} ms")
    print(f"  select, warm threshold    {med(warm):8.2f} ms   "
          f"(last call: {warm_sel.last_passes} pass(es), {warm_sel.last_candidates} candidates)")
    print(f"  torch.topk                {med(topk):8.2f} ms")
    print(f"  explore ({k_e} around {len(core)})  {med(explore_ms):8.3f} ms")
    print(f"  speed-up over topk: cold {med(topk) / med(cold):.1f}x, "
          f"warm {med(topk) / med(warm):.1f}x; same set as topk: {exact}")


if __name__ == "__main__":
    main()
