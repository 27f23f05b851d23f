"""Synthetic throughput benchmark: images/sec of a ResNet-style model on random data.

Shaped like Horovod's PyTorch synthetic benchmark (warm-up batches, then timed iterations of
several batches each, reported as mean ± 1.96 std per rank and in total), written fresh and
without torchvision. ``import hvd_slim as hvd`` is the one changed line; Slim-DP settings come
from the environment, as Horovod's do:

    mpirun -np 4 --oversubscribe --bind-to none .venv/bin/python examples/synthetic_benchmark.py
    HVD_SLIM_DENSITY=1.0 mpirun -np 4 ... examples/synthetic_benchmark.py   # dense, to compare

The defaults are sized for CPUs (64x64 images, fewer batches than Horovod's 224x224 and
10/10/10); ``--image-size 224 --num-warmup-batches 10 --num-batches-per-iter 10 --num-iters 10``
gives Horovod's shape of run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import hvd_slim as hvd  # was: import horovod.torch as hvd


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and an identity (or 1x1 projection) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """An ImageNet-style ResNet: 7x7/2 stem and max-pool, four stages of basic blocks
    (64, 128, 256, 512 channels), global average pool, linear classifier. ``small_images``:
    a 3x3/1 stem without max-pool instead, as used on 32x32 images (CIFAR)."""

    def __init__(self, blocks: List[int], num_classes: int = 1000,
                 small_images: bool = False) -> None:
        super().__init__()
        if small_images:
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64),
                                      nn.ReLU(inplace=True))
        else:
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                      nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for i, n in enumerate(blocks):
            cout = 64 * 2 ** i
            for j in range(n):
                layers.append(BasicBlock(cin, cout, 2 if j == 0 and i > 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


MODELS = {"resnet18": [2, 2, 2, 2], "resnet10": [1, 1, 1, 1]}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="resnet18")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--num-warmup-batches", type=int, default=5)
    p.add_argument("--num-batches-per-iter", type=int, default=5)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--fp16-allreduce", action="store_true",
                   help="Horovod's fp16 compression (hvd_slim: its dense tensors)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures to OUT")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    """Run the benchmark; rank 0 prints the results."""
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = ResNet(MODELS[args.model])
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=compression)
    # Horovod's optimizer has no Slim-DP settings: the same script runs under both imports
    config = getattr(opt, "slim_config", None)
    density = config.density if config is not None else 1.0
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, 1000, (args.batch_size,))

    def benchmark_step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()

    def log(text: str) -> None:
        if hvd.rank() == 0:
            print(text, flush=True)

    params = sum(p.numel() for p in model.parameters())
    log(f"Model: {args.model} ({params / 1e6:.1f}M parameters), density {density:g}")
    log(f"Batch size: {args.batch_size} per rank, images {args.image_size}x{args.image_size}")
    log(f"Number of ranks: {hvd.size()}")
    log("Running warmup...")
    for _ in range(args.num_warmup_batches):
        benchmark_step()
    log("Running benchmark...")
    rates = []
    for i in range(args.num_iters):
        start = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            benchmark_step()
        rate = args.batch_size * args.num_batches_per_iter / (time.perf_counter() - start)
        log(f"Iter #{i}: {rate:.1f} img/sec per rank")
        rates.append(rate)
    mean = statistics.fmean(rates)
    spread = 1.96 * (statistics.stdev(rates) if len(rates) > 1 else 0.0)
    log(f"Img/sec per rank: {mean:.1f} +-{spread:.1f}")
    n = hvd.size()
    log(f"Total img/sec on {n} rank(s): {n * mean:.1f} +-{n * spread:.1f}")
    if hvd.rank() == 0 and args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "world_size": hvd.size(), "parameters": params,
                       "density": density, "runtime": hvd.__name__,
                       "img_sec_per_rank": rates, "mean": mean, "spread_1.96std": spread},
                      f, indent=2)


if __name__ == "__main__":
    main()
