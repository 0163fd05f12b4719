"""A user's own data: arrays handed to `from_arrays` (the public API) or a `.npz` file
(`config.data.name='npz'`), checked before anything trains on them."""

from __future__ import annotations

import os

import numpy as np

from fedjax_pfedes.data.sources import (
    MAX_CLASSES,
    CentralDataset,
    LoadOptions,
    check_inputs,
    integer_labels,
    make_dataset,
)
from fedjax_pfedes.errors import DataError, DatasetUnavailableError


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
