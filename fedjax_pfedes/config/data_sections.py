"""`config.data` and `config.clients`: the dataset, its split into clients, their models."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from fedjax_pfedes.config.fields import Section, above, at_least, between, param
from fedjax_pfedes.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class DataSection(Section):
    """`config.data`: the dataset, how it is split into clients, and their local splits."""

    SECTION: ClassVar[str] = "data"

    name: str = param(
        "mnist5k", "the dataset (docs/guide/datasets.md): offline 'mnist5k' | 'mnist_shifted' | "
        "'digits' | 'breast_cancer' | 'wine' | 'iris' | 'synthetic_text' | 'npz'; tfds "
        "'cifar10' | 'cifar100' | 'mnist' | 'fashion_mnist' | 'emnist_balanced' | "
        "'emnist_byclass' | 'ag_news'; TFF files 'femnist' | 'femnist_digits'")
    data_dir: str = param("", "tfds data_dir ('' = tfds default); femnist: the h5 folder")
    path: str = param("", "'npz': the .npz file (x_train, y_train, x_test, y_test)")
    max_train_samples: int = param(
        0, "keep a seeded random subset of the pool (0 = all)", at_least(0, " (0 = all)"))
    shifted_samples: int = param(200_000, "'mnist_shifted': pool size (shifted MNIST-5k digits)",
                                 at_least(1))
    text_max_length: int = param(64, "text: tokens per example (truncate / pad)", at_least(1))
    text_vocab_size: int = param(10000, "text: vocabulary incl. padding (0) and unknown (1)",
                                 at_least(3))
    global_test_fraction: float = param(
        0.2, "held out as the global test set (datasets without an official test split)",
        between(0, 1))
    public_fraction: float = param(
        0.0, "share of the training pool held out as public data (class-stratified, seeded) "
        "before the partition: no client owns it; launch.pretrain_proxy trains E_proxy on it "
        "(0 = none)", between(0, 1, "[)"))
    num_clients: int = param(20, "clients of the federation", at_least(1))
    partition: str = param(
        "dirichlet", "'iid' | 'dirichlet' | 'pathological' | 'quantity_skew' | 'natural' "
        "(writers; femnist / npz)")
    dirichlet_alpha: float = param(0.3, "Dirichlet label skew: smaller = more skew", above(0))
    min_samples_per_client: int = param(
        40, "Dirichlet / quantity skew: guaranteed minimum samples per client", at_least(0))
    quantity_sigma: float = param(
        1.0, "quantity skew: client sizes ~ LogNormal(0, sigma)", at_least(0))
    classes_per_client: int = param(2, "pathological: classes each client holds (at most the "
                                    "dataset's classes)", at_least(1))
    class_share_low: float = param(0.4, "pathological: per-(client, class) share ~ U(low, high)",
                                   above(0))
    class_share_high: float = param(0.6, "pathological: the upper end of that share (>= low)",
                                    above(0))
    local_test_fraction: float = param(
        0.2, "each client's local test split (0.2: train:test 8:2)", between(0, 1))
    validation_split: bool = param(
        False, "True: the local test split is set aside unseen and each client is evaluated on "
        "a validation split of the same fraction held out of its training rows (launch.compare "
        "tunes learning rates this way, on a seed it does not report)")

    def check(self) -> None:
        if self.class_share_low > self.class_share_high:
            raise ConfigError(f"config.data.class_share_low ({self.class_share_low}) must be <= "
                              f"config.data.class_share_high ({self.class_share_high})")


@dataclasses.dataclass(frozen=True)
class ClientsSection(Section):
    """`config.clients`: the clients' architectures and initialization."""

    SECTION: ClassVar[str] = "clients"

    architectures: str = param(
        "convnet3,convnet5,vit", "'a,b,c' cycles over the clients; 'a:8,b:6,c:6' assigns blocks "
        "of these sizes")
    same_init: bool = param(
        False, "True: every client of one architecture starts from the same private model (the "
        "published pFedES runs do); False: each its own random initialization")
    shared_arch: str = param(
        "", "the small model every client shares in FML, FedKD and FedMRL ('' = per modality: "
        "image 'cnn_small', tabular 'mlp_small', text 'embedbag')")
