"""Per-client data held as padded stacked arrays with true sizes.

A cohort's clients are processed in one call, so their arrays must share a shape: each client's
samples are padded to the largest client of the group and `sizes` records how many are real.
Padded rows are zeros and every loss, metric and batch sampler masks them out.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from flax import struct

from fedjax_pfedes.data import partitions
from fedjax_pfedes.data.sources import CentralDataset
from fedjax_pfedes.errors import ConfigError


@struct.dataclass
class ClientArrays:
    """Samples of several clients: `x` [clients, max_samples, ...], `y` and `sizes` [clients].

    `step_limit` [clients] (optional, training arrays only) caps the local steps a client takes
    this round: adaptive local epochs, the minimum-samples rule and partial work before a round
    deadline (`fedjax_pfedes.engine.client_system`) set it; None = no cap beyond the configured
    epochs.
    """

    x: np.ndarray
    y: np.ndarray
    sizes: np.ndarray
    step_limit: np.ndarray | None = None

    @property
    def num_clients(self) -> int:
        return int(self.sizes.shape[0])

    @property
    def capacity(self) -> int:
        """Rows per client (the padded length)."""
        return int(self.y.shape[1])


def stack_clients(x: np.ndarray, y: np.ndarray, client_indices: list[np.ndarray]
                  ) -> ClientArrays:
    """Gathers each client's rows of (x, y) and zero-pads them to a common length."""
    sizes = np.array([len(i) for i in client_indices], np.int32)
    longest = max(int(sizes.max(initial=0)), 1)
    xs = np.zeros((len(client_indices), longest) + x.shape[1:], x.dtype)
    ys = np.zeros((len(client_indices), longest), np.int32)
    for k, idx in enumerate(client_indices):
        xs[k, : len(idx)] = x[idx]
        ys[k, : len(idx)] = y[idx]
    return ClientArrays(xs, ys, sizes)


@dataclasses.dataclass(frozen=True)
class FederatedData:
    """A partitioned dataset: which pool rows each client trains and tests on, plus the pool.

    Attributes:
      central: the centralized dataset (pool + global test set).
      train_indices, test_indices: per client, rows of `central.x_train` in its local
        train / local test split.
    """

    central: CentralDataset
    train_indices: list[np.ndarray]
    test_indices: list[np.ndarray]

    @property
    def num_clients(self) -> int:
        return len(self.train_indices)

    def train_label_counts(self) -> np.ndarray:
        """[clients, classes] label histogram of every client's local train split."""
        y, classes = self.central.y_train, self.central.num_classes
        return np.stack([np.bincount(y[idx], minlength=classes) for idx in self.train_indices])

    def client_arrays(self, client_ids: np.ndarray, split: str) -> ClientArrays:
        """Padded arrays of the given clients' local `split` ('train' or 'test')."""
        chosen = self.train_indices if split == "train" else self.test_indices
        c = self.central
        return stack_clients(c.x_train, c.y_train, [chosen[int(k)] for k in client_ids])


PARTITIONS = ("iid", "dirichlet", "pathological", "quantity_skew", "natural")


def partition_dataset(central: CentralDataset, num_clients: int, partition: str, seed: int,
                      local_test_fraction: float = 0.2, dirichlet_alpha: float = 0.5,
                      min_samples_per_client: int = 10, classes_per_client: int = 2,
                      class_share_low: float = 0.4, class_share_high: float = 0.6,
                      quantity_sigma: float = 1.0, validation: bool = False) -> FederatedData:
    """Partitions `central`'s pool over clients and splits each client into local train/test.

    With `validation`, each client's local test split is set aside unseen and replaced by a
    validation split held out of its training rows (the same fraction, class-stratified, its own
    seed), so hyper-parameters tuned on it never read the reported test data."""
    y = central.y_train
    if partition == "iid":
        parts = partitions.iid_partition(y, num_clients, seed)
    elif partition == "dirichlet":
        parts = partitions.dirichlet_partition(y, num_clients, dirichlet_alpha,
                                               min_samples_per_client, seed)
    elif partition == "pathological":
        parts = partitions.pathological_partition(y, num_clients, classes_per_client, seed,
                                                  class_share_low, class_share_high)
    elif partition == "quantity_skew":
        parts = partitions.quantity_skew_partition(y, num_clients, quantity_sigma,
                                                   min_samples_per_client, seed)
    elif partition == "natural":
        parts = partitions.natural_partition(central.groups_train, num_clients, seed)
    else:
        raise ConfigError(f"config.data.partition: unknown partition '{partition}'; "
                         f"known: {list(PARTITIONS)}")
    train, test = partitions.local_train_test_split(y, parts, local_test_fraction, seed + 1)
    if validation:
        train, test = partitions.local_train_test_split(y, train, local_test_fraction, seed + 2)
    empty = [k for k, idx in enumerate(train) if len(idx) == 0]
    if empty:
        raise ConfigError(f"clients {empty[:10]} received no training samples; lower "
                         "config.data.num_clients or raise config.data.min_samples_per_client")
    no_test = [k for k, idx in enumerate(test) if len(idx) == 0]
    if no_test:
        raise ConfigError(
            f"clients {no_test[:10]} have no local test sample (e.g. client {no_test[0]}: "
            f"{len(train[no_test[0]])} train samples, no class with 2 or more), so their "
            "personalized accuracy is undefined; raise config.data.min_samples_per_client or "
            "lower config.data.num_clients")
    return FederatedData(central, train, test)
