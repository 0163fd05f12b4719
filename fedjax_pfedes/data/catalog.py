"""Config name -> dataset loader, for every source the simulator can read."""

from __future__ import annotations

from collections.abc import Callable

from fedjax_pfedes.data import arrays, offline_sources, sources, text
from fedjax_pfedes.data.femnist import FILES as FEMNIST_FILES
from fedjax_pfedes.data.femnist import femnist_loader
from fedjax_pfedes.data.sources import CentralDataset, LoadOptions
from fedjax_pfedes.data.tfds_sources import TFDS_DATASETS, tfds_loader
from fedjax_pfedes.errors import ConfigError, DataError


def load_synthetic_text(options: LoadOptions) -> CentralDataset:
    """6,000 generated topic-classification documents (4 classes), offline; see
    `text.synthetic_topic_corpus` for the generative model. Not real text."""
    vocab = min(options.text_vocab_size, 2000)
    x, y = text.synthetic_topic_corpus(6000, 4, vocab, options.text_max_length, seed=1234)
    return sources.from_single_pool("synthetic_text", "text", x, y, 4, options, vocab_size=vocab)


LOADERS: dict[str, Callable[[LoadOptions], CentralDataset]] = {
    "mnist5k": offline_sources.load_mnist5k,
    "mnist_shifted": offline_sources.load_mnist_shifted,
    "digits": offline_sources.load_sklearn_digits,
    "breast_cancer": offline_sources.load_breast_cancer,
    "wine": offline_sources.load_wine,
    "iris": offline_sources.load_iris,
    "synthetic_text": load_synthetic_text,
    "npz": arrays.load_npz,
    **{name: tfds_loader(name) for name in TFDS_DATASETS},
    **{name: femnist_loader(name) for name in FEMNIST_FILES},
}

BUILT_IN = frozenset(LOADERS)


def register_dataset(name: str, loader: Callable[[LoadOptions], CentralDataset]) -> None:
    """Makes a dataset usable by name in `config.data.name`.

    Args:
      name: the name configs use; a built-in name is refused, a name registered earlier in this
        process is replaced.
      loader: a function of the `LoadOptions` (seed, subsampling, paths) returning the dataset,
        typically `lambda options: arrays.from_arrays(name, x_train, y_train, x_test, y_test,
        options=options)`; pass `client_ids=` there to give each client its own natural group
        (`config.data.partition='natural'`).
    """
    if name in BUILT_IN:
        raise ValueError(f"register_dataset: '{name}' is a built-in dataset; choose another name")
    if not callable(loader):
        raise ValueError(f"register_dataset('{name}'): loader must be a function of the "
                         f"LoadOptions, got {type(loader).__name__}")
    LOADERS[name] = loader


def load_dataset(name: str, options: LoadOptions | None = None) -> CentralDataset:
    """Loads a registered dataset by its config name (see `LOADERS`)."""
    options = options or LoadOptions()
    if name not in LOADERS:
        raise ConfigError(f"config.data.name: unknown dataset '{name}'; known: {sorted(LOADERS)}")
    data = LOADERS[name](options)
    if not isinstance(data, CentralDataset):
        raise DataError(f"config.data.name='{name}': its loader must return a CentralDataset "
                        f"(e.g. fedjax_pfedes.from_arrays(...)), returned {type(data).__name__}")
    return data
