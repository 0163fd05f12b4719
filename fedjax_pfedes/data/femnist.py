"""Federated EMNIST with its natural per-writer split, read from TFF's HDF5 files.

Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018; the files are those of
TensorFlow Federated's `tff.simulation.datasets.emnist` (fed_emnist_train.h5 / fed_emnist_test.h5,
3,383 writers, 62 classes; fed_emnist_digitsonly_*.h5 for the 10 digits). Layout:
`examples/<writer id>/pixels` [n, 28, 28] float in [0, 1] with dark ink on a white background,
and `examples/<writer id>/label` [n]. Pixels are inverted to MNIST's convention (ink = 1) and
stored as uint8. The train file is the pool, with each sample's writer in `groups_train` for
`config.data.partition='natural'`; the test file is the global test set.
"""

from __future__ import annotations

import os

import numpy as np

from fedjax_pfedes.data.sources import CentralDataset, LoadOptions, make_dataset
from fedjax_pfedes.errors import DatasetUnavailableError

FILES = {"femnist": ("fed_emnist_train.h5", "fed_emnist_test.h5", 62),
         "femnist_digits": ("fed_emnist_digitsonly_train.h5", "fed_emnist_digitsonly_test.h5",
                            10)}


def read_writers(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pixels uint8 [N, 28, 28, 1] with ink = 255, labels [N], writer index [N]) of a file."""
    import h5py

    xs, ys, groups = [], [], []
    with h5py.File(path, "r") as f:
        for index, writer in enumerate(sorted(f["examples"].keys())):
            group = f["examples"][writer]
            pixels = np.asarray(group["pixels"], np.float32)
            xs.append(np.round((1.0 - pixels) * 255.0).astype(np.uint8))
            ys.append(np.asarray(group["label"], np.int64).reshape(-1))
            groups.append(np.full(len(pixels), index, np.int64))
    return np.concatenate(xs)[..., None], np.concatenate(ys), np.concatenate(groups)


def femnist_loader(config_name: str):
    train_file, test_file, num_classes = FILES[config_name]

    def load(options: LoadOptions) -> CentralDataset:
        folder = options.data_dir
        paths = [os.path.join(folder, name) for name in (train_file, test_file)]
        missing = [p for p in paths if not os.path.exists(p)]
        if not folder or missing:
            raise DatasetUnavailableError(
                f"config.data.name='{config_name}' reads TFF's federated EMNIST files "
                f"{train_file} and {test_file} from config.data.data_dir "
                f"({folder or 'empty'}; missing: {missing or [train_file, test_file]}). "
                "Nothing was downloaded. On a machine with internet, fetch "
                "https://storage.googleapis.com/tff-datasets-public/fed_emnist.tar.bz2 (or "
                "fed_emnist_digitsonly.tar.bz2), unpack it, and pass "
                "--config.data.data_dir=<that folder>.")
        x_train, y_train, groups = read_writers(paths[0])
        x_test, y_test, _ = read_writers(paths[1])
        return make_dataset(config_name, "image", x_train, y_train, x_test, y_test, num_classes,
                            options, groups_train=groups)

    load.__doc__ = (f"Federated EMNIST ({num_classes} classes) with writer ids, from "
                    f"{train_file} / {test_file} in config.data.data_dir.")
    return load
