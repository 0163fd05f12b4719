"""Centralized datasets before partitioning: `CentralDataset`, the checks every loader's arrays
pass (`make_dataset`), and a single pool split into training pool and global test set.

The loaders: data that ships with PyPI packages in `offline_sources.py`, a user's arrays or
`.npz` file in `arrays.py`, tensorflow-datasets and TFF's federated EMNIST in `tfds_sources.py`
and `femnist.py`; `catalog.py` maps config names to all of them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fedjax_pfedes.config.defaults import DataSection, TopLevel
from fedjax_pfedes.data import normalization
from fedjax_pfedes.data.spec import MODALITIES, InputSpec
from fedjax_pfedes.errors import DataError


def integer_labels(y: np.ndarray, where: str, array: str) -> np.ndarray:
    """`y` as int64 labels, refusing what a cast would silently change: a label array that is
    not a vector (one-hot labels), non-finite or fractional float labels."""
    y = np.asarray(y)
    if y.ndim != 1:
        hint = " (one-hot labels? store their argmax)" if y.ndim == 2 else ""
        raise DataError(f"{where}: {array} must be a vector of integer labels, got shape "
                        f"{y.shape}{hint}")
    if y.dtype == bool or not (np.issubdtype(y.dtype, np.integer)
                               or np.issubdtype(y.dtype, np.floating)):
        raise DataError(f"{where}: {array} must hold integer labels, got dtype {y.dtype}")
    if np.issubdtype(y.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(y) | (y != np.round(y)))
        if len(bad):
            raise DataError(f"{where}: {array}[{bad[0]}] = {float(y[bad[0]]):g} is not an "
                            f"integer label ({len(bad)} such values)")
    return y.astype(np.int64)


# More classes than this is a label-encoding mistake (a hash, a 2**40 id), not a task: a
# classifier head (and a label histogram per client) of that size would not fit in memory.
MAX_CLASSES = 100_000
# Input dimensions per example by modality: [H, W, C] images, [L] token ids, [F] features.
INPUT_RANK = {"image": 3, "text": 1, "tabular": 1}
FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_inputs(x, where: str, array: str, modality: str) -> np.ndarray:
    """`x` as a numeric array, refusing what training would silently mangle or crash on: a
    dtype that is not a real number (strings, objects, complex values, whose imaginary part a
    cast drops), a rank other than [N, *modality's example shape], an empty array, and float
    values beyond float32's range (they pass a finiteness check and overflow in the model)."""
    x = np.asarray(x)
    if x.dtype == bool or not (np.issubdtype(x.dtype, np.integer)
                               or np.issubdtype(x.dtype, np.floating)):
        raise DataError(f"{where}: {array} must hold real numbers, got dtype {x.dtype}")
    rank = INPUT_RANK.get(modality)
    if rank is not None and x.ndim != rank + 1:
        shape = {"image": "[N, H, W, C] (or [N, H, W])", "text": "[N, L] token ids",
                 "tabular": "[N, F] features"}[modality]
        raise DataError(f"{where}: {modality} {array} must have shape {shape}, got "
                        f"{x.shape}")
    if len(x) == 0:
        raise DataError(f"{where}: {array} is empty (it needs at least one example)")
    if np.issubdtype(x.dtype, np.floating) and x.dtype.itemsize > 4:
        big = np.flatnonzero(np.nan_to_num(np.abs(x.reshape(len(x), -1)), nan=0.0,
                                           posinf=0.0).max(axis=1) > FLOAT32_MAX)
        if len(big):
            raise DataError(f"{where}: {array}[{big[0]}] holds values beyond float32's range "
                            f"(|x| > {FLOAT32_MAX:.3g}); rescale the inputs")
    return x


def _first_nonfinite_row(x: np.ndarray) -> int | None:
    if not np.issubdtype(x.dtype, np.floating) or x.size == 0:
        return None
    bad = np.flatnonzero(~np.isfinite(x.reshape(len(x), -1)).all(axis=1))
    return int(bad[0]) if len(bad) else None


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """How to load a dataset (the `config.data` fields that loaders read).

    Attributes:
      seed: seeds the global test hold-out and any subsampling.
      global_test_fraction: share held out as the global test set, for datasets without an
        official test split.
      data_dir: tensorflow-datasets data directory ('' = tfds's default, $TFDS_DATA_DIR or
        ~/tensorflow_datasets); for 'femnist', the folder holding TFF's fed_emnist_*.h5 files.
      path: the file read by the 'npz' source.
      max_train_samples: keep a seeded random subset of the training pool of this size (0 = all).
      text_max_length: text: tokens kept per example (longer texts are truncated).
      text_vocab_size: text: vocabulary size including padding (0) and out-of-vocabulary (1).
      shifted_samples: 'mnist_shifted': size of its training pool.
    """

    seed: int = TopLevel.seed
    global_test_fraction: float = DataSection.global_test_fraction
    data_dir: str = DataSection.data_dir
    path: str = DataSection.path
    max_train_samples: int = DataSection.max_train_samples
    text_max_length: int = DataSection.text_max_length
    text_vocab_size: int = DataSection.text_vocab_size
    shifted_samples: int = DataSection.shifted_samples


@dataclasses.dataclass(frozen=True)
class CentralDataset:
    """A labelled dataset before partitioning.

    Attributes:
      name: registry name of the dataset.
      modality: 'image', 'text' or 'tabular'.
      x_train, y_train: the pool that is partitioned across clients.
      x_test, y_test: the global test set (never seen by any client during training).
      num_classes: number of labels.
      feature_mean, feature_std: statistics of `x_train` used by every model's input
        normalization (images: per channel in [0, 1] units; tabular: per feature; text: empty).
      vocab_size: text only: number of token ids.
      groups_train: optional natural group (e.g. writer) of every pool sample, for the
        'natural' partition.
    """

    name: str
    modality: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    feature_mean: np.ndarray
    feature_std: np.ndarray
    vocab_size: int = 0
    groups_train: np.ndarray | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def input_spec(self) -> InputSpec:
        return InputSpec(self.modality, self.input_shape, self.x_train.dtype.name,
                         tuple(map(float, self.feature_mean)), tuple(map(float, self.feature_std)),
                         self.vocab_size)


def _checked_split(split: str, x, y, where: str, modality: str, num_classes: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of one split, checked: integer labels in [0, num_classes), one example per row,
    as many rows as labels, finite inputs; `DataError` naming `where`, the array and the
    first offending index otherwise."""
    y = integer_labels(y, where, f"y_{split}")
    if np.ndim(x) < 2:
        raise DataError(f"{where}: x_{split} must hold one example per row, got shape "
                        f"{np.shape(x)}")
    x = check_inputs(x, where, f"x_{split}", modality)
    if len(x) != len(y):
        raise DataError(f"{where}: x_{split} has {len(x)} rows but y_{split} has {len(y)}")
    outside = np.flatnonzero((y < 0) | (y >= num_classes))
    if len(outside):
        raise DataError(f"{where}: y_{split}[{outside[0]}] = {y[outside[0]]} is outside "
                        f"[0, {num_classes}) ({len(outside)} such labels)")
    row = _first_nonfinite_row(np.asarray(x))
    if row is not None:
        raise DataError(f"{where}: x_{split}[{row}] holds a non-finite value (NaN or Inf)")
    return x, y


def _typed_inputs(modality: str, x_train: np.ndarray, x_test: np.ndarray, vocab_size: int,
                  where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, x_test, mean, std): images and tables with the training pool's
    normalization statistics (tables as float32), text as int32 token ids in the vocabulary
    (`DataError` otherwise) without statistics."""
    if modality == "image":
        mean, std = normalization.image_statistics(x_train)
    elif modality == "tabular":
        mean, std = normalization.tabular_statistics(x_train)
    else:
        mean = std = np.zeros(0, np.float32)
        for split, x in (("x_train", x_train), ("x_test", x_test)):
            if not np.issubdtype(x.dtype, np.integer) or (x.size and (
                    x.min() < 0 or x.max() >= vocab_size)):
                raise DataError(f"{where}: text {split} must hold integer token ids in "
                                f"[0, vocab_size={vocab_size})")
        x_train, x_test = x_train.astype(np.int32), x_test.astype(np.int32)
    if modality == "tabular":
        x_train, x_test = x_train.astype(np.float32), x_test.astype(np.float32)
    return x_train, x_test, mean, std


def make_dataset(name: str, modality: str, x_train: np.ndarray, y_train: np.ndarray,
                 x_test: np.ndarray, y_test: np.ndarray, num_classes: int,
                 options: LoadOptions | None = None, vocab_size: int = 0,
                 groups_train: np.ndarray | None = None, source: str = "") -> CentralDataset:
    """Checks the arrays, subsamples the pool if asked and computes the input statistics.

    Raises `DataError` (naming `source`, e.g. the file, or the dataset, the array and the first
    offending index) for: x/y length or shape mismatches, labels that are not integer vectors
    in [0, num_classes), fewer than 2 classes in the training pool, non-finite inputs, text
    tokens outside the vocabulary.
    """
    options = options or LoadOptions()
    where = source or f"dataset '{name}'"
    if modality not in MODALITIES:
        raise DataError(f"{where}: modality must be one of {MODALITIES}, got '{modality}'")
    if not 2 <= num_classes <= MAX_CLASSES:
        raise DataError(f"{where}: num_classes must be in [2, {MAX_CLASSES}], got {num_classes}")
    x_train, y_train = _checked_split("train", x_train, y_train, where, modality, num_classes)
    x_test, y_test = _checked_split("test", x_test, y_test, where, modality, num_classes)
    if len(np.unique(y_train)) < 2:
        raise DataError(f"{where}: y_train holds {len(np.unique(y_train))} distinct class(es); "
                        "classification needs at least 2 (every accuracy would be 1.0)")
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DataError(f"{where}: x_train examples have shape {x_train.shape[1:]} but x_test "
                        f"examples {x_test.shape[1:]}")
    if groups_train is not None:
        groups_train = _group_ids(groups_train, where)
    if groups_train is not None and len(groups_train) != len(y_train):
        raise DataError(f"{where}: groups_train has {len(groups_train)} entries for "
                        f"{len(y_train)} training samples")
    if 0 < options.max_train_samples < len(y_train):
        keep = np.sort(np.random.default_rng(options.seed).permutation(len(y_train))
                       [: options.max_train_samples])
        x_train, y_train = x_train[keep], y_train[keep]
        groups_train = None if groups_train is None else groups_train[keep]
    x_train, x_test, mean, std = _typed_inputs(modality, x_train, x_test, vocab_size, where)
    return CentralDataset(name, modality, x_train, y_train.astype(np.int32), x_test,
                          y_test.astype(np.int32), int(num_classes), mean, std, vocab_size,
                          groups_train)


def stratified_holdout(y: np.ndarray, test_fraction: float, seed: int
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Indices (pool, test) that hold out `test_fraction` of every class."""
    rng = np.random.default_rng(seed)
    test_idx = []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        test_idx.append(idx[: int(round(test_fraction * len(idx)))])
    is_test = np.zeros(len(y), bool)
    is_test[np.concatenate(test_idx)] = True
    return np.flatnonzero(~is_test), np.flatnonzero(is_test)


def from_single_pool(name: str, modality: str, x: np.ndarray, y: np.ndarray, num_classes: int,
                     options: LoadOptions, vocab_size: int = 0) -> CentralDataset:
    """A dataset without an official test split: a stratified global test set is held out."""
    pool, test = stratified_holdout(y, options.global_test_fraction, options.seed)
    return make_dataset(name, modality, x[pool], y[pool], x[test], y[test], num_classes, options,
                        vocab_size)


def _group_ids(groups: np.ndarray, where: str) -> np.ndarray:
    """The natural group (client) ids: one finite integer per training sample."""
    groups = np.asarray(groups)
    if groups.ndim != 1:
        raise DataError(f"{where}: client_ids / groups_train must be one id per training "
                        f"sample (1-D), got shape {groups.shape}")
    if np.issubdtype(groups.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(groups) | (groups != np.round(groups)))
        if len(bad):
            raise DataError(f"{where}: client_ids[{int(bad[0])}] = "
                            f"{groups[bad[0]].item()!r} is not an integer id")
        groups = groups.astype(np.int64)
    elif not (np.issubdtype(groups.dtype, np.integer) or groups.dtype.kind in "US"):
        raise DataError(f"{where}: client_ids must be integers or strings, got dtype "
                        f"{groups.dtype}")
    return groups
