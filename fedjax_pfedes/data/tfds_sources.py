"""Datasets read through tensorflow-datasets' random-access `tfds.data_source` (no TensorFlow).

CIFAR-10, CIFAR-100, MNIST, Fashion-MNIST, EMNIST (balanced / byclass) and AG News (text). The
official train split is the pool that is partitioned over clients and the official test split is
the global test set. Nothing is ever downloaded from here: a dataset that is not prepared in
`config.data.data_dir` fails at once with the commands that prepare it, instead of letting tfds
retry a download for minutes on a machine without internet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from fedjax_pfedes.data import text
from fedjax_pfedes.data.sources import CentralDataset, LoadOptions, make_dataset
from fedjax_pfedes.errors import DatasetUnavailableError

# config name -> (tfds name, modality)
TFDS_DATASETS: dict[str, tuple[str, str]] = {
    "cifar10": ("cifar10", "image"),
    "cifar100": ("cifar100", "image"),
    "mnist": ("mnist", "image"),
    "fashion_mnist": ("fashion_mnist", "image"),
    "emnist_balanced": ("emnist/balanced", "image"),
    "emnist_byclass": ("emnist/byclass", "image"),
    "ag_news": ("ag_news_subset", "text"),
}


def preparation_instructions(tfds_name: str, data_dir: str) -> str:
    where = data_dir or "~/tensorflow_datasets (or $TFDS_DATA_DIR)"
    dir_flag = f" --data_dir={data_dir}" if data_dir else ""
    return (
        f"tensorflow-datasets '{tfds_name}' is not prepared in {where}, and this simulator never "
        "downloads (nothing was attempted). Prepare it on a machine with internet:\n"
        f"  pip install tensorflow tensorflow-datasets array_record\n"
        f"  tfds build {tfds_name} --file_format=array_record{dir_flag}\n"
        "then copy the prepared folder here and point --config.data.data_dir at its parent "
        "directory (random access through tfds.data_source needs the array_record format).")


def open_split(tfds_name: str, split: str, data_dir: str) -> Any:
    """A random-access source over one split, or DatasetUnavailableError with instructions."""
    import tensorflow_datasets as tfds

    try:
        return tfds.data_source(tfds_name, split=split, data_dir=data_dir or None,
                                download=False)
    except Exception as error:  # tfds reports a missing dataset with several error types
        builder = tfds.builder(tfds_name, data_dir=data_dir or None)
        if not builder.is_prepared():
            raise DatasetUnavailableError(
                preparation_instructions(tfds_name, data_dir)) from None
        raise DatasetUnavailableError(
            f"tensorflow-datasets '{tfds_name}' is prepared in {builder.data_dir} but cannot be "
            f"read by random access ({type(error).__name__}: {error}). Rebuild it with "
            f"`tfds build {tfds_name} --file_format=array_record`.") from error


def read_all(source: Any, description: str) -> list[dict[str, Any]]:
    """Every example of a data source, in order."""
    return [source[i] for i in tqdm(range(len(source)), desc=description, unit="ex",
                                    leave=False, mininterval=2.0)]


def _image_arrays(examples: list[dict[str, Any]], transpose: bool
                  ) -> tuple[np.ndarray, np.ndarray]:
    x = np.stack([np.asarray(e["image"], np.uint8) for e in examples])
    if transpose:
        x = np.swapaxes(x, 1, 2)
    y = np.array([int(e["label"]) for e in examples], np.int64)
    return x, y


def _load_tfds(config_name: str, options: LoadOptions) -> CentralDataset:
    import tensorflow_datasets as tfds

    tfds_name, modality = TFDS_DATASETS[config_name]
    train_source = open_split(tfds_name, "train", options.data_dir)
    test_source = open_split(tfds_name, "test", options.data_dir)
    num_classes = tfds.builder(tfds_name, data_dir=options.data_dir or None
                               ).info.features["label"].num_classes
    train = read_all(train_source, f"{tfds_name} train")
    test = read_all(test_source, f"{tfds_name} test")
    if modality == "image":
        # EMNIST is stored transposed (tfds docs: "inverted horizontally and rotated 90
        # anti-clockwise"); swapping H and W makes its characters upright like MNIST's.
        transpose = tfds_name.startswith("emnist")
        x_train, y_train = _image_arrays(train, transpose)
        x_test, y_test = _image_arrays(test, transpose)
        return make_dataset(config_name, "image", x_train, y_train, x_test, y_test, num_classes,
                            options)
    docs_train = [f"{_text(e['title'])} {_text(e['description'])}" for e in train]
    docs_test = [f"{_text(e['title'])} {_text(e['description'])}" for e in test]
    vocabulary = text.build_vocabulary(docs_train, options.text_vocab_size)
    x_train = text.encode(docs_train, vocabulary, options.text_max_length)
    x_test = text.encode(docs_test, vocabulary, options.text_max_length)
    y_train = np.array([int(e["label"]) for e in train], np.int64)
    y_test = np.array([int(e["label"]) for e in test], np.int64)
    return make_dataset(config_name, "text", x_train, y_train, x_test, y_test, num_classes,
                        options, vocab_size=len(vocabulary) + 2)


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def tfds_loader(config_name: str) -> Callable[[LoadOptions], CentralDataset]:
    def load(options: LoadOptions) -> CentralDataset:
        return _load_tfds(config_name, options)

    tfds_name, modality = TFDS_DATASETS[config_name]
    load.__doc__ = f"tensorflow-datasets '{tfds_name}' ({modality}), official train/test splits."
    return load
