"""Dense vs Slim-DP on real MNIST, side by side, in one MPI job.

Run from the repository root (this is what `make demo` runs):

    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    mpirun -np 4 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 \
        .venv/bin/python -m examples.demo

(The two OMPI_ALLOW_* variables are only needed when running as root; `--oversubscribe` lets
4 ranks share fewer cores; `--bind-to none` stops Open MPI from pinning several ranks onto the
same core.) Add `--json demo.json` to keep the figures.

Each rank trains a small CNN on its own shard of MNIST (DistributedSampler) twice from the same
seed: once with density=1.0 (hvd_slim then performs an exact dense average) and once with Slim-DP
at --density. Rank 0 then prints one markdown table with test accuracy and the bytes this rank
put on / took off the wire per step. The data are examples/mnist.py's: no network access.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hvd_slim as hvd
from examples.mnist import load_mnist


class Net(nn.Module):
    """Two 5x5 convolutions and two fully connected layers (about 215k weights).

    fc1 alone has 200k weights and conv2 12.8k, so a small density has something to compress;
    the small layers (conv1, biases, fc2) are below hvd_slim's compression threshold.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
        self.fc1 = nn.Linear(32 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy in percent; each rank scores a disjoint slice, summed with allreduce."""
    model.eval()
    xs, ys = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]   # every image counted once
    with torch.no_grad():
        correct = sum(int((model(xs[i:i + 1000]).argmax(1) == ys[i:i + 1000]).sum())
                      for i in range(0, len(ys), 1000))
    counts = hvd.allreduce(torch.tensor([float(correct), float(len(ys))]), op=hvd.Sum)
    model.train()
    return 100.0 * float(counts[0]) / float(counts[1])


def parse_args() -> argparse.Namespace:
    """Command-line flags; the defaults finish in about 3 minutes on 2 cores at 4 ranks."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--density", type=float, default=None,
                   help="density of the Slim-DP run (default: hvd_slim's own defaults)")
    p.add_argument("--train-subset", type=int, default=None, metavar="N",
                   help="train on the first N training images only (default: all 60000)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures to OUT")
    p.add_argument("--network", default="as launched",
                   help="what the ranks' traffic crosses, for the caption (make demo sets it)")
    return p.parse_args()


def train_once(name: str, density: Optional[float], args: argparse.Namespace,
               train_set: TensorDataset | Subset, test: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """Train a fresh model from ``args.seed`` at ``density`` and return its figures."""
    torch.manual_seed(args.seed)  # same initial weights for both runs (and rank 0 broadcasts them)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # density None: no Slim-DP keyword at all, hvd_slim's shipped defaults.
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   **({} if density is None else {"density": density}))
    density = opt.slim_config.density
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    # Same seed => same shuffles in both runs; equal shard sizes => equal step counts per rank,
    # which the collective exchange inside opt.step() requires.
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                 shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    start = time.perf_counter()
    loss_sum, batches = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        loss_sum, batches = 0.0, 0
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss_sum, batches = loss_sum + loss.item(), batches + 1
        if hvd.rank() == 0:
            print(f"{name}: epoch {epoch + 1}/{args.epochs}, mean training loss "
                  f"{loss_sum / max(batches, 1):.4f} on rank 0", flush=True)
    stats = opt.comm_stats()  # training steps only: read before flush()
    opt.flush()  # apply every pending residual so we evaluate the exact model
    seconds = time.perf_counter() - start
    accuracy = evaluate(model, *test)
    # Mean training loss of the last epoch, averaged over ranks (hvd.allreduce's default).
    train_loss = float(hvd.allreduce(torch.tensor([loss_sum / max(batches, 1)])))
    steps = max(int(stats["steps"]), 1)
    pushed = stats["bytes_pushed"] / steps
    return {
        "method": name, "density": density, "test_accuracy": accuracy,
        "steps": int(stats["steps"]),
        "bytes_pushed_per_step": pushed,
        "bytes_pulled_per_step": stats["bytes_pulled"] / steps,
        "dense_bytes_per_step": stats["dense_bytes"] / steps,
        "dense_over_pushed": stats["dense_bytes"] / stats["bytes_pushed"]
        if stats["bytes_pushed"] else float("inf"),
        "train_seconds": seconds,
        "last_epoch_train_loss": train_loss,
    }


def format_table(rows: list[dict]) -> str:
    """The results as one markdown table."""
    lines = ["| method | density | test acc. (%) | steps | pushed B/step | pulled B/step "
             "| dense B/step | dense/pushed | train s | ms/step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['density']:g} | {r['test_accuracy']:.2f} | {r['steps']} "
            f"| {r['bytes_pushed_per_step']:,.0f} | {r['bytes_pulled_per_step']:,.0f} "
            f"| {r['dense_bytes_per_step']:,.0f} | {r['dense_over_pushed']:.1f}x "
            f"| {r['train_seconds']:.1f} | {1e3 * r['train_seconds'] / max(r['steps'], 1):.0f} |")
    return "\n".join(lines)


def main() -> None:
    """Run the dense and the Slim-DP training back to back and report them."""
    args = parse_args()
    hvd.init()
    # Ranks share the machine's cores; more than one thread each only adds contention.
    torch.set_num_threads(1)

    x_train, y_train = load_mnist("train")
    train_set: TensorDataset | Subset = TensorDataset(x_train, y_train)
    if args.train_subset is not None:
        train_set = Subset(train_set, range(min(args.train_subset, len(train_set))))
    test = load_mnist("test")

    rows = [train_once("dense", 1.0, args, train_set, test),
            train_once("slim-dp", args.density, args, train_set, test)]
    if hvd.rank() == 0:
        print(f"\nMNIST, {hvd.size()} ranks, {len(train_set)} training images, "
              f"{args.epochs} epoch(s), batch {args.batch_size}/rank, lr {args.lr}; "
              f"bytes are rank 0's, per optimizer step; network: {args.network}\n")
        print(format_table(rows), flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"world_size": hvd.size(), "train_images": len(train_set),
                           "network": args.network,
                           "args": vars(args), "runs": rows}, f, indent=2)


if __name__ == "__main__":
    main()
