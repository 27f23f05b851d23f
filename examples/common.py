"""Pieces shared by the example scripts: models, data sets, evaluation and the progress bar.

Every function that needs the runtime takes the ``hvd`` module it should use (``hvd_slim`` or
``horovod.torch``), so the same code serves ``--method horovod``. Nothing here touches the
network: the data come from examples/data.py.
"""
from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Iterable, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for `data` when run by path
from data import load_mnist, load_mnist1d  # noqa: E402

TestSet = Tuple[torch.Tensor, torch.Tensor]


class Net(nn.Module):
    """Two 5x5 convolutions and two fully connected layers (about 215k weights).

    fc1 alone has 200k weights and conv2 12.8k, so density 0.01 has something to compress;
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


class MLP1D(nn.Module):
    """An MLP for MNIST-1D's 40-sample signals: 40 -> 256 -> 256 -> 10 (78k weights).

    The two large weight matrices (10k and 65k) are compressed; biases and the 2.5k head travel
    dense. An MLP tops out far below 100% on MNIST-1D (the dataset's point), so accuracy keeps
    discriminating between settings instead of saturating.
    """

    def __init__(self, hidden: int = 256) -> None:
        super().__init__()
        self.fc1 = nn.Linear(40, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def make_model(dataset: str) -> nn.Module:
    """The example model for ``dataset`` ("mnist" or "mnist1d")."""
    return Net() if dataset == "mnist" else MLP1D()


def load_dataset(dataset: str, train_subset: int | None = None,
                 data_seed: int = 0) -> Tuple[Dataset, TestSet]:
    """``(train set, (x_test, y_test))`` for "mnist" (60k/10k real MNIST) or "mnist1d".

    ``train_subset`` keeps the first N training examples. MNIST-1D is generated from
    ``data_seed`` (the same data for every training seed, so seeds vary only the training).
    MNIST-1D uses 12000 samples (9600 train / 2400 test) rather than the published 5000: a
    2400-image test set halves the sampling noise of a 1000-image one.
    """
    if dataset == "mnist":
        train: Dataset = TensorDataset(*load_mnist("train"))
        test = load_mnist("test")
    elif dataset == "mnist1d":
        (xt, yt), test = load_mnist1d(seed=data_seed, num_samples=12000)
        train = TensorDataset(xt, yt)
    else:
        raise ValueError(f"dataset must be 'mnist' or 'mnist1d', got {dataset!r}")
    if train_subset is not None:
        train = Subset(train, range(min(train_subset, len(train))))
    return train, test


def evaluate(hvd: ModuleType, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy in percent; each rank scores a disjoint slice, summed with allreduce."""
    model.eval()
    # A strided slice without padding, so every test image is counted exactly once.
    xs, ys = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    correct = 0
    with torch.no_grad():
        for i in range(0, len(ys), 1000):
            correct += int((model(xs[i:i + 1000]).argmax(1) == ys[i:i + 1000]).sum())
    counts = hvd.allreduce(torch.tensor([float(correct), float(len(ys))]), op=hvd.Sum)
    model.train()
    return 100.0 * float(counts[0]) / float(counts[1])


def progress(iterable: Iterable, desc: str, enabled: bool) -> Iterable:
    """A tqdm bar when ``enabled`` (rank 0), else plain iteration (also when tqdm is missing)."""
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=desc, mininterval=2.0, dynamic_ncols=True, file=sys.stderr)
