"""The exchange's phases timed on one device: selection, encoding, decoding and the server's
aggregation for N simulated ranks, against ``torch.topk`` and a dense allreduce of the same
gradient on that device.

    python -m benchmarks.gpu_phases --model resnet50 --densities 0.01,0.001 --ranks 4

Each simulated rank is a :class:`~hvd_slim.exchange.worker.Worker` with its own parameters,
residuals and selectors, and one :class:`~hvd_slim.exchange.server.Server` aggregates their
pushes, as :class:`~hvd_slim.exchange.step.SlimExchange` runs them over a transport, but one
after another on one thread, so every phase's time is its own (the transport's part is the
dense allreduce row, timed separately). Messages take the device path (uint8 tensors on the
parameters' device) wherever the device is not the CPU. Times are medians of device-synchronised
wall times over ``--steps`` steps after ``--warmup``; the phases of N ranks are per rank.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

from hvd_slim.config import SlimConfig
from hvd_slim.exchange.expect import push_expect
from hvd_slim.exchange.layout import Layout
from hvd_slim.exchange.sections import itemsizes
from hvd_slim.exchange.server import Server
from hvd_slim.exchange.stats import ExchangeStats
from hvd_slim.exchange.wirepath import DevicePath, HostPath
from hvd_slim.exchange.worker import Worker
from hvd_slim.selection import CoreSelector
from hvd_slim.wire import message as wm

from .models import SHAPES


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], object]) -> tuple:
    """(fn's result, its device-synchronised wall time in ms)."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, (time.perf_counter() - t0) * 1e3


class Ranks:
    """N simulated ranks' parameters and workers, and the server (on rank 0), on one device."""

    def __init__(self, model: str, n: int, config: SlimConfig, device: torch.device,
                 device_path: bool) -> None:
        shapes = SHAPES[model]()
        self.device, self.cfg, self.n = device, config, n
        # device_path: messages as device tensors even on a CPU (--device-path)
        self.path = DevicePath(device) if device.type != "cpu" or device_path else HostPath()
        self.named = [[(name, torch.nn.Parameter(torch.zeros(shape, device=device)))
                       for name, shape in shapes] for _ in range(n)]
        self.layouts = [Layout(named, config, lambda dt: dt) for named in self.named]
        layout = self.layouts[0]
        self.digest = layout.digest() ^ int(config.digest(), 16)
        self.workers = [Worker(lay, config, r, n, self.digest, self.path,
                               ExchangeStats(lay, n)) for r, lay in enumerate(self.layouts)]
        self.server = Server(layout, config, n, 0, self.path)
        # Per-layer gradient scales differ, as in real networks, so the top-k is not uniform.
        self.scales = [1.0 / max(1.0, float(torch.Size(s)[1:].numel()) ** 0.5)
                       for _, s in shapes]

    def fill_grads(self, t: int) -> None:
        for r, named in enumerate(self.named):
            g = torch.Generator(device=self.device).manual_seed(1_000_003 * r + t)
            for (_, p), s in zip(named, self.scales):
                p.grad = torch.randn(p.shape, generator=g, device=self.device).mul_(s)

    @property
    def sparse_numel(self) -> int:
        return sum(b.numel for b in self.layouts[0].sparse)


def run_density(model: str, n: int, density: float, device: torch.device, steps: int,
                warmup: int, device_path: bool = False) -> Dict[str, object]:
    """Every phase's median per-step time (ms) at one density, and the bytes moved."""
    config = SlimConfig(density=density, warmup_decay_steps=0)
    rk = Ranks(model, n, config, device, device_path)
    times: Dict[str, List[float]] = {k: [] for k in
                                     ("select", "encode", "decode", "serve", "pull_decode",
                                      "apply")}
    for t in range(warmup + steps):
        rk.fill_grads(t)
        buckets = rk.layouts[0].at_step(t)
        got: Dict[str, float] = {k: 0.0 for k in times}
        bufs = []
        for w in rk.workers:
            (sections, report), ms = _timed(device, lambda w=w: w.select(t, w.compensate(t)))
            assert report is None, report
            got["select"] += ms
            (buf, _), ms = _timed(device, lambda w=w, s=sections[0]: rk.path.encode(
                wm.PUSH, w.rank, t, rk.digest, s, itemsizes(buckets, s)))
            got["encode"] += ms
            bufs.append(buf)
        expect = push_expect(buckets, False)
        for j, buf in enumerate(bufs):
            _, ms = _timed(device, lambda j=j, buf=buf: rk.path.decode(
                buf, kind=wm.PUSH, sender=j, step=t, digest=rk.digest, expect=expect,
                who=f"push from rank {j}"))
            got["decode"] += ms
        reply, got["serve"] = _timed(device, lambda: rk.server.serve(bufs, t, rk.digest))
        for w in rk.workers:
            pulled, ms = _timed(device, lambda w=w: w.read_pulls([reply], t, False))
            got["pull_decode"] += ms
            _, ms = _timed(device, lambda w=w, p=pulled: w.apply(p, t))
            got["apply"] += ms
        rk.server.settle(True)
        if t >= warmup:
            for k in times:
                # Per rank, except the server's own work (it runs once).
                times[k].append(got[k] if k == "serve" else got[k] / n)
    # The last step's messages (1-D numpy arrays or uint8 tensors: len() is their bytes).
    sizes = {"push_bytes": len(bufs[0]), "pull_bytes": len(reply)}
    med = {k: statistics.median(v) for k, v in times.items()}
    # The server's decoding is measured on its own; its aggregation is the rest of serve().
    med["aggregate"] = max(0.0, med["serve"] - n * med["decode"])
    d = rk.sparse_numel
    k = max(1, round(density * d))
    a = torch.randn(d, generator=torch.Generator(device=device).manual_seed(5), device=device)
    sel = CoreSelector()
    sel.select_magnitude(a, k)   # warm: the threshold is carried over, as between steps
    med["core_select"] = statistics.median(
        _timed(device, lambda: sel.select_magnitude(a, k))[1] for _ in range(steps))
    med["torch_topk"] = statistics.median(
        _timed(device, lambda: torch.topk(a.abs(), k, sorted=False))[1] for _ in range(steps))
    return {"density": density, "numel": sum(p.numel() for _, p in rk.named[0]),
            "compressed_numel": d, "k": k, "ms": med, **sizes,
            "dense_bytes": 4 * sum(p.numel() for _, p in rk.named[0])}


def dense_allreduce_ms(numel: int, device: torch.device, steps: int) -> Dict[str, object]:
    """A dense allreduce of ``numel`` float32 values over torch.distributed (NCCL on a GPU, Gloo
    on the CPU), in the world this process is in: its own 1-rank group unless launched under
    torchrun (then every rank of it)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    own = not dist.is_initialized()
    if own:
        if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend)
        else:
            store = tempfile.mktemp(prefix="gpu_phases_store_")
            dist.init_process_group(backend, init_method=f"file://{store}", rank=0,
                                    world_size=1)
    x = torch.randn(numel, device=device)
    dist.all_reduce(x)
    ms = statistics.median(_timed(device, lambda: dist.all_reduce(x))[1] for _ in range(steps))
    out = {"backend": backend, "world_size": dist.get_world_size(), "ms": ms}
    if own:
        dist.destroy_process_group()
    return out


def main() -> None:
    """Parse arguments, run every density, print a table and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50", choices=sorted(SHAPES))
    ap.add_argument("--densities", default="0.01,0.001")
    ap.add_argument("--ranks", type=int, default=4, help="simulated workers (the server is one)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--device-path", action="store_true",
                    help="on a CPU: messages and selection take the device path's torch code")
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.device_path:
        from hvd_slim.selection import backend
        backend.FORCE_TORCH = True
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = [run_density(args.model, args.ranks, float(d), device, args.steps, args.warmup,
                        args.device_path) for d in args.densities.split(",")]
    dense = dense_allreduce_ms(rows[0]["numel"], device, args.steps)
    result = {"device": name, "torch": torch.__version__, "model": args.model,
              "ranks": args.ranks, "steps": args.steps, "rows": rows, "dense_allreduce": dense}
    print(f"{args.model} on {name} (torch {torch.__version__}), {args.ranks} simulated ranks, "
          f"{rows[0]['numel']:,} parameters ({rows[0]['compressed_numel']:,} compressed); "
          f"median ms per step, per rank unless marked")
    cols = ("select", "encode", "decode", "aggregate", "pull_decode", "apply", "core_select",
            "torch_topk")
    print("| density | k | " + " | ".join(cols) + " | push B | pull B |")
    for r in rows:
        ms = r["ms"]
        print(f"| {r['density']:g} | {r['k']:,} | " + " | ".join(f"{ms[c]:.2f}" for c in cols)
              + f" | {r['push_bytes']:,} | {r['pull_bytes']:,} |")
    print(f"dense allreduce of {rows[0]['numel']:,} float32 ({rows[0]['dense_bytes']:,} B) over "
          f"{dense['backend']} at world size {dense['world_size']}: {dense['ms']:.2f} ms")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
