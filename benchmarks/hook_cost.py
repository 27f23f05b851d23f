"""What the DDP hook costs beyond ``DistributedOptimizer``: one process over Gloo (world size 1,
the rank its own server), the same parameters and gradients through each path, so what differs
is the path's own work and no wire or other rank is in it.

    python -m benchmarks.hook_cost --model resnet18 --steps 6 --repeats 4

Series, each with its own copy of the parameters, their steps taken in turn (a block of
``--steps`` each, ``--repeats`` times) so that the machine's drift hits them alike:

- ``backward``: backward alone (the synthetic gradients, benchmarks/models.py: a copy);
- ``sgd``: backward and the plain ``torch.optim.SGD`` step, no exchange;
- ``do``: ``hvd_slim.DistributedOptimizer`` at its defaults over a Gloo transport;
- ``hook``: DDP in its own buckets (25 MB) with ``slim_hook`` (``SlimState().register``);
- ``hook_1b``: the same with every parameter in one bucket;
- ``hook_1bv``: one bucket with ``gradient_as_bucket_view=True``.

The automatic warm-up is off (``warmup_decay_steps=0``) so every timed step is a steady one.
A series' cost is its median step less backward's; the ratios the DDP issue reads are each
hook's over ``do``'s. Timing on a busy machine says little: run it quiet (the load is printed).
"""
from __future__ import annotations

import json
import os
import statistics
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import hvd_slim
from hvd_slim.ddp import SlimState
from hvd_slim.ddp.group import group_transport

from .models import SHAPES, SyntheticGrads
from .step_cost import _timed, probe_parser

SERIES = ("backward", "sgd", "do", "hook", "hook_1b", "hook_1bv")


class _Path:
    """One series: its own parameters, their gradients, and the step that exchanges them."""

    def __init__(self, shapes: Any, series: str) -> None:
        self.model = SyntheticGrads(shapes, rank=0)
        named = self.model.named_shaped()
        params = [p for _, p in named]
        self.series = series
        self.module: torch.nn.Module = self.model
        self.opt: Any = torch.optim.SGD(params, lr=0.01, momentum=0.9)
        if series == "do":
            transport, _ = group_transport(None, torch.device("cpu"))
            self.opt = hvd_slim.DistributedOptimizer(self.opt, named_parameters=named,
                                                     warmup_decay_steps=0, transport=transport)
        elif series.startswith("hook"):
            mb = sum(p.numel() * p.element_size() for p in params) / 2 ** 20 + 1
            kwargs: Dict[str, Any] = {} if series == "hook" else {"bucket_cap_mb": mb}
            self.module = DistributedDataParallel(
                self.model, gradient_as_bucket_view=series == "hook_1bv", **kwargs)
            SlimState(warmup_decay_steps=0).register(self.module)

    def step(self, t: int) -> None:
        self.opt.zero_grad()
        torch.autograd.backward(self.module(t), self.model.grads(t))
        if self.series != "backward":
            self.opt.step()


def measure(model: str, steps: int, repeats: int) -> Dict[str, Any]:
    """The figures (seconds per step, medians over every timed step). Initialises a Gloo
    process group of one rank in this process when none is."""
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    shapes = SHAPES[model]()
    paths = {s: _Path(shapes, s) for s in SERIES}
    load = [os.getloadavg()[0]]
    t0 = 3
    for p in paths.values():   # DDP lays its buckets out again after its first iterations
        _timed(p.step, range(t0))
    times: Dict[str, List[float]] = {s: [] for s in SERIES}
    for _ in range(repeats):
        for s, p in paths.items():
            times[s] += _timed(p.step, range(t0, t0 + steps))
        t0 += steps
    load.append(os.getloadavg()[0])
    med = {s: statistics.median(v) for s, v in times.items()}
    cost = {s: med[s] - med["backward"] for s in SERIES if s != "backward"}
    return {"model": model, "tensors": len(shapes), "steps": steps, "repeats": repeats,
            "load": load, "medians_s": med, "cost_s": cost,
            "over_do": {s: cost[s] / cost["do"] for s in cost if s.startswith("hook")},
            "do_over_sgd": cost["do"] / cost["sgd"]}


def _report(r: Dict[str, Any], out: Callable[[str], None]) -> None:
    out(f"{r['model']}: {r['tensors']} tensors, one process over Gloo, medians of "
        f"{r['steps']} x {r['repeats']} interleaved steps, load {r['load'][0]:.1f} -> "
        f"{r['load'][1]:.1f}; a step's cost is its time less backward's "
        f"({1e3 * r['medians_s']['backward']:.1f} ms)")
    names = {"sgd": "plain SGD step", "do": "DistributedOptimizer", "hook": "slim_hook, DDP's "
             "buckets", "hook_1b": "slim_hook, one bucket", "hook_1bv": "one bucket, bucket view"}
    for s, c in r["cost_s"].items():
        tail = f"   {r['over_do'][s]:.2f}x DistributedOptimizer" if s in r["over_do"] else \
            (f"   {r['do_over_sgd']:.1f}x SGD" if s == "do" else "")
        out(f"  {names[s]:28s} {1e3 * c:8.1f} ms{tail}")


def main() -> None:
    args = probe_parser(__doc__, steps=6, repeats=4).parse_args()
    r = measure(args.model, args.steps, args.repeats)
    _report(r, print)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
