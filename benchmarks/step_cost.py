"""What hvd_slim's own arithmetic costs: one process that is its own server, so ``opt.step()``
is the whole local work of a step, against the plain ``torch.optim.SGD`` step of the same
parameters (one streaming pass over them: the floor).

    python -m benchmarks.step_cost --model resnet18 --steps 20 --repeats 3

The gradients are seeded and cycled (benchmarks/models.py, ``SyntheticGrads``), so backward is a
copy. Each repeat times, interleaved on one thread: backward alone, backward plus SGD's step,
backward plus hvd_slim's step at its defaults, the same parameters as one flat tensor; a step's
cost is its time less backward's. The automatic warm-up (the first ``1/density`` steps, denser)
is timed afterwards on a fresh optimizer over the same shapes, each of its steps beside one
steady step of the first (a drift of the machine's load moves both alike). It prints the
ratios the local-work issue sets targets for (hvd_slim over SGD, 62 tensors over one flat
tensor, warm-up over steady), the steady steps' phase times from ``comm_stats()``, and the
machine's load: timing on a busy machine says little, so run it quiet.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import torch

import hvd_slim
from hvd_slim.transport import FakeCluster

from .models import SHAPES, SyntheticGrads


def _timed(fn: Callable[[int], None], steps: range) -> List[float]:
    out = []
    for t in steps:
        start = time.perf_counter()
        fn(t)
        out.append(time.perf_counter() - start)
    return out


class _Setup:
    """One parameter set (``shapes``) with its gradients, a plain SGD and hvd_slim over it."""

    def __init__(self, shapes: Any) -> None:
        self.model = SyntheticGrads(shapes, rank=0)
        self.named = self.model.named_shaped()
        params = [p for _, p in self.named]
        self.sgd = torch.optim.SGD(params, lr=0.01, momentum=0.9)
        # Its own copy of the parameters: hvd_slim's steps must not move the plain SGD's.
        self.slim_model = SyntheticGrads(shapes, rank=0)
        named = self.slim_model.named_shaped()
        inner = torch.optim.SGD([p for _, p in named], lr=0.01, momentum=0.9)
        self.slim = hvd_slim.DistributedOptimizer(inner, named_parameters=named,
                                                  transport=FakeCluster(1).transport(0))

    def backward(self, model: SyntheticGrads, t: int) -> None:
        torch.autograd.backward(model(t), model.grads(t))

    def plain(self, t: int) -> None:
        self.sgd.zero_grad()
        self.backward(self.model, t)
        self.sgd.step()

    def only_backward(self, t: int) -> None:
        self.sgd.zero_grad()
        self.backward(self.model, t)

    def slim_step(self, t: int) -> None:
        self.slim.zero_grad()
        self.backward(self.slim_model, t)
        self.slim.step()


def measure(model: str, steps: int, repeats: int) -> Dict[str, Any]:
    """The probe's figures (seconds per step, medians over every timed step)."""
    torch.set_num_threads(1)
    shapes = SHAPES[model]()
    numel = sum(int(torch.Size(s).numel()) for _, s in shapes)
    many, flat = _Setup(shapes), _Setup([("flat", (numel,))])
    warm = many.slim.slim_config.warmup_steps
    load = [os.getloadavg()[0]]
    # Through the automatic warm-up, both layouts: the steady state is timed first.
    _timed(many.slim_step, range(warm))
    _timed(flat.slim_step, range(warm))
    for fn in (many.plain, many.only_backward, flat.plain, flat.only_backward):
        fn(0)   # first-touch allocations out of the timings
    times: Dict[str, List[float]] = {k: [] for k in
                                     ("backward", "sgd", "slim", "flat_backward", "flat_sgd",
                                      "flat_slim")}
    before = many.slim.comm_stats()
    t0 = warm
    for _ in range(repeats):   # interleaved: a load change hits every series alike
        block = range(t0, t0 + steps)
        times["backward"] += _timed(many.only_backward, block)
        times["sgd"] += _timed(many.plain, block)
        times["slim"] += _timed(many.slim_step, block)
        times["flat_backward"] += _timed(flat.only_backward, block)
        times["flat_sgd"] += _timed(flat.plain, block)
        times["flat_slim"] += _timed(flat.slim_step, block)
        t0 += steps
    after = many.slim.comm_stats()
    warmup, beside = _warmup_beside(shapes, many, warm, t0)
    load.append(os.getloadavg()[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    sgd, slim = med["sgd"] - med["backward"], med["slim"] - med["backward"]
    flat_slim = med["flat_slim"] - med["flat_backward"]
    # comm_stats() sums each phase's seconds: the steady steps' share, per step.
    phases = {k[:-len("_seconds")]: (after[k] - before[k]) / (steps * repeats)
              for k in ("prepare_seconds", "select_seconds", "serve_seconds", "apply_seconds")}
    return {"model": model, "tensors": len(shapes), "numel": numel, "steps": steps,
            "repeats": repeats, "warmup_steps": warm, "load": load,
            "sgd_step_s": sgd, "slim_step_s": slim, "flat_slim_step_s": flat_slim,
            "slim_over_sgd": slim / sgd, "tensors_over_flat": slim / flat_slim,
            "warmup_over_steady": (statistics.median(warmup) - med["backward"])
            / (statistics.median(beside) - med["backward"]) if warmup else None,
            "phases_s": phases, "medians_s": med}


def _warmup_beside(shapes: Any, steady: _Setup, warm: int, t0: int
                   ) -> Tuple[List[float], List[float]]:
    """The automatic warm-up's steps of a fresh optimizer over ``shapes``, each timed beside
    one step of ``steady`` (past its warm-up, from step ``t0``): both lists of seconds."""
    fresh = _Setup(shapes)
    warmup, beside = [], []
    for t in range(warm):
        warmup += _timed(fresh.slim_step, range(t, t + 1))
        beside += _timed(steady.slim_step, range(t0 + t, t0 + t + 1))
    return warmup, beside


def probe_parser(doc: str, steps: int, repeats: int) -> argparse.ArgumentParser:
    """The one-process probes' command line (this one's, benchmarks/hook_cost.py's): the shapes,
    the timed steps per series and repeat, the repeats, and where the JSON goes."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", default="resnet18", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=steps, help="timed steps per series and repeat")
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--json", help="also write the figures here")
    return ap


def main() -> None:
    args = probe_parser(__doc__, steps=20, repeats=3).parse_args()
    r = measure(args.model, args.steps, args.repeats)
    print(f"{r['model']}: {r['tensors']} tensors, {r['numel']:,} parameters, one process, "
          f"medians of {r['steps']} x {r['repeats']} interleaved steps, load "
          f"{r['load'][0]:.1f} -> {r['load'][1]:.1f}")
    print(f"  plain SGD step        {1e3 * r['sgd_step_s']:8.1f} ms")
    print(f"  hvd_slim step         {1e3 * r['slim_step_s']:8.1f} ms   "
          f"{r['slim_over_sgd']:.1f}x SGD (target <= 8x)")
    print(f"  one flat tensor       {1e3 * r['flat_slim_step_s']:8.1f} ms   "
          f"{len(SHAPES[args.model]())} tensors cost {r['tensors_over_flat']:.2f}x it "
          f"(target <= 1.2x)")
    if r["warmup_over_steady"] is not None:
        print(f"  warm-up ({r['warmup_steps']} steps)    {r['warmup_over_steady']:.2f}x a steady "
              f"step (target <= 1.5x)")
    phases = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in r["phases_s"].items())
    print(f"  phases per steady step (ms; select is part of prepare): {phases}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
