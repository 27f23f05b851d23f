"""The study's tasks: models, data sets, what training minimises and how a model is scored.

Every function that needs the runtime takes the ``hvd`` module it should use (``hvd_slim`` or
``horovod.torch``), so the same code serves ``--method horovod``. The MNIST models are the
examples' own: examples/demo.py's CNN and Horovod's example CNN (examples/mnist.py). Nothing
here touches the network: the data come from data.py and lm.py.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Dict, Iterable, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset, TensorDataset

from examples.demo import Net
from examples.mnist import Net as HorovodNet

from . import lm
from .data import load_mnist, load_mnist1d

TestSet = Tuple[torch.Tensor, torch.Tensor]


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


MODELS = {"net": Net, "mlp1d": MLP1D, "horovod-cnn": HorovodNet, "byte-lm": lm.ByteLM,
          # the fair horizon's 0.5M-parameter transformer (fair.py)
          "byte-lm-small": functools.partial(lm.ByteLM, width=96, layers=4)}
DEFAULT_MODEL = {"mnist": "net", "mnist1d": "mlp1d", "pystdlib": "byte-lm"}
LM_CONTEXT = 128      # bytes of context of the language model
LM_VAL_WINDOWS = 512  # validation windows (64k bytes) scored at every evaluation


def make_model(dataset: str, name: str | None = None) -> nn.Module:
    """The model ``name`` (see ``MODELS``), by default the example model for ``dataset``:
    ``Net`` for "mnist", ``MLP1D`` for "mnist1d", ``ByteLM`` for "pystdlib"."""
    if name is None:
        name = DEFAULT_MODEL[dataset]
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    return MODELS[name]()


@functools.lru_cache(maxsize=1)
def stdlib_corpus() -> lm.Corpus:
    """This interpreter's standard-library corpus, read and hashed once per process (the data
    set and its identity come from the same read)."""
    return lm.load_corpus()


def dataset_identity(dataset: str) -> Dict[str, Any]:
    """What identifies the data beyond its name, for the results: the language model's corpus
    digest and sizes (it is whatever standard library this interpreter has); {} otherwise."""
    return {"corpus": stdlib_corpus().describe()} if dataset == "pystdlib" else {}


def load_dataset(dataset: str, train_subset: int | None = None,
                 data_seed: int = 0) -> Tuple[Dataset, TestSet]:
    """``(train set, (x_test, y_test))`` for "mnist" (60k/10k real MNIST), "mnist1d" or
    "pystdlib" (byte windows of the standard library's sources, lm.py).

    ``train_subset`` keeps the first N training examples (for "pystdlib": N windows drawn from
    the whole training corpus by ``data_seed``, so a short run still sees every file; beyond the
    corpus, every window once and a second draw of the excess, each seen twice). MNIST-1D
    is generated from ``data_seed`` (the same data for every training seed, so seeds vary only
    the training). MNIST-1D uses 12000 samples (9600 train / 2400 test) rather than the
    published 5000: a 2400-image test set halves the sampling noise of a 1000-image one.
    """
    if dataset == "mnist":
        train: Dataset = TensorDataset(*load_mnist("train"))
        test = load_mnist("test")
    elif dataset == "mnist1d":
        (xt, yt), test = load_mnist1d(seed=data_seed, num_samples=12000)
        train = TensorDataset(xt, yt)
    elif dataset == "pystdlib":
        corpus = stdlib_corpus()
        train = lm.Windows(corpus.train, LM_CONTEXT)
        test = lm.validation_windows(corpus.val, LM_CONTEXT, LM_VAL_WINDOWS)
        if train_subset is not None:
            g = torch.Generator().manual_seed(data_seed)
            n = len(train)
            pick = torch.randperm(n, generator=g)[:train_subset].sort().values
            if train_subset > n:   # a second pass over a seeded draw of the excess
                again = torch.randperm(n, generator=g)[:train_subset - n].sort().values
                pick = torch.cat([pick, again])
            return Subset(train, pick.tolist()), test
    else:
        raise ValueError(f"dataset must be 'mnist', 'mnist1d' or 'pystdlib', got {dataset!r}")
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


def classification_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the model's class scores."""
    return F.cross_entropy(model(x), y)


@dataclass(frozen=True)
class Task:
    """What a dataset's training minimises and how its model is scored (``metric`` and
    ``flushed`` name the score's keys in the training records)."""

    metric: str
    flushed: str
    higher_is_better: bool
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    score: Callable[[ModuleType, nn.Module, torch.Tensor, torch.Tensor], float]


CLASSIFICATION = Task("test_accuracy", "flushed_accuracy", True, classification_loss, evaluate)
LANGUAGE = Task("val_bpb", "flushed_val_bpb", False, lm.lm_loss, lm.evaluate_bpb)


def task_of(dataset: str) -> Task:
    """The task of ``dataset``: next-byte prediction for "pystdlib", else classification."""
    return LANGUAGE if dataset == "pystdlib" else CLASSIFICATION


def progress(iterable: Iterable, desc: str, enabled: bool) -> Iterable:
    """A tqdm bar when ``enabled`` (rank 0), else plain iteration (also when tqdm is missing)."""
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=desc, mininterval=2.0, dynamic_ncols=True, file=sys.stderr)
