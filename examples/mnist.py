"""The MNIST script users start from, as Horovod's PyTorch example writes it, with one change:
``import hvd_slim as hvd`` instead of ``import horovod.torch as hvd``. Nothing is tuned for
hvd_slim: SGD with lr 0.01 x size and momentum 0.5, batch 64, the example's CNN with dropout.

    mpirun -np 4 --oversubscribe --bind-to none .venv/bin/python examples/horovod_mnist.py
    HVD_SLIM_DENSITY=0.001 mpirun -np 4 ... examples/horovod_mnist.py   # any Slim-DP setting

The convergence study's untuned battery (benchmarks/untuned.py) runs this model and these
settings, and variations of them, over 3 seeds. Data: examples/data.py (offline).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # data, common when run by path
import hvd_slim as hvd  # noqa: E402  (was: import horovod.torch as hvd)
from common import HorovodNet  # noqa: E402
from data import load_mnist  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--train-subset", type=int, default=None, help="first N training images")
    args = p.parse_args()

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train = TensorDataset(*load_mnist("train"))
    if args.train_subset:
        train = Subset(train, range(args.train_subset))
    x_test, y_test = load_mnist("test")
    sampler = DistributedSampler(train, num_replicas=hvd.size(), rank=hvd.rank())
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    model = HorovodNet()
    # Horovod's example scales the learning rate by the number of workers.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(),
                                momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    for epoch in range(1, args.epochs + 1):
        model.train()
        sampler.set_epoch(epoch)
        for data, target in loader:
            optimizer.zero_grad()
            F.nll_loss(model(data), target).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():   # each rank scores its share of the test set
            xs, ys = x_test[hvd.rank()::hvd.size()], y_test[hvd.rank()::hvd.size()]
            correct = (model(xs).argmax(1) == ys).sum().float()
        total = hvd.allreduce(torch.stack([correct, torch.tensor(float(len(ys)))]), op=hvd.Sum)
        if hvd.rank() == 0:
            stats = optimizer.comm_stats()
            print(f"epoch {epoch}: test accuracy {100 * float(total[0] / total[1]):.2f}%, "
                  f"{stats['dense_bytes'] / stats['bytes_pushed']:.1f}x fewer bytes pushed "
                  f"than dense (density {optimizer.slim_config.density:g})", flush=True)


if __name__ == "__main__":
    main()
