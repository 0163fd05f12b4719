"""The label-distribution profile of a partition : what a split looks like
before anyone trains on it.

Per client: local train and test sizes, the label histogram, the KL divergence of its label
distribution from the global one, and the number of classes it covers; over clients: the
coefficient of variation of sizes. Plots live in `fedjax_pfedes.io.plotting`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from fedjax_pfedes import markdown
from fedjax_pfedes.data.federated import FederatedData


def kl_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """KL(p || q) in nats for distributions over the same classes (0 log 0 = 0)."""
    p = np.asarray(p, np.float64)
    q = np.asarray(q, np.float64)
    support = p > 0
    if np.any(q[support] == 0):
        return float("inf")
    return float(np.sum(p[support] * np.log(p[support] / q[support])))


def coefficient_of_variation(values: np.ndarray) -> float:
    """Population standard deviation over mean (0 for an empty or all-zero vector)."""
    values = np.asarray(values, np.float64)
    mean = values.mean() if values.size else 0.0
    return float(values.std() / mean) if mean > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class DataProfile:
    """Label and size statistics of the clients' local train splits.

    Attributes:
      label_counts: [clients, classes] local-train label histogram.
      train_sizes, test_sizes: [clients] local split sizes.
      global_distribution: [classes] label distribution of all clients' train samples together.
      kl_to_global: [clients] KL(client's label distribution || global), nats.
      classes_covered: [clients] classes with at least one local-train sample.
      size_cv: coefficient of variation of `train_sizes` (population std / mean).
    """

    dataset: str
    partition: str
    label_counts: np.ndarray
    train_sizes: np.ndarray
    test_sizes: np.ndarray
    global_distribution: np.ndarray
    kl_to_global: np.ndarray
    classes_covered: np.ndarray
    size_cv: float

    @property
    def num_clients(self) -> int:
        return int(self.label_counts.shape[0])

    @property
    def num_classes(self) -> int:
        return int(self.label_counts.shape[1])

    def summary(self) -> dict[str, Any]:
        """Aggregates and per-client values, JSON-ready."""
        def stats(v):
            v = np.asarray(v, np.float64)
            return {"min": float(v.min()), "median": float(np.median(v)),
                    "mean": float(v.mean()), "max": float(v.max())}

        return {
            "dataset": self.dataset, "partition": self.partition,
            "num_clients": self.num_clients, "num_classes": self.num_classes,
            "train_samples": int(self.train_sizes.sum()),
            "test_samples": int(self.test_sizes.sum()),
            "train_size": stats(self.train_sizes), "size_cv": self.size_cv,
            "kl_to_global": stats(self.kl_to_global),
            "classes_covered": stats(self.classes_covered),
            "per_client": {"train_size": self.train_sizes, "test_size": self.test_sizes,
                           "kl_to_global": self.kl_to_global,
                           "classes_covered": self.classes_covered,
                           "label_counts": self.label_counts},
        }

    def table(self) -> str:
        """A Markdown summary table (min / median / mean / max over clients)."""
        rows = [("local train samples", self.train_sizes), ("local test samples", self.test_sizes),
                ("KL to global label distribution (nats)", self.kl_to_global),
                ("classes covered", self.classes_covered)]
        lines = [f"{self.dataset}, partition '{self.partition}': {self.num_clients} clients, "
                 f"{self.num_classes} classes, {int(self.train_sizes.sum())} train / "
                 f"{int(self.test_sizes.sum())} test samples on clients; coefficient of "
                 f"variation of client sizes {self.size_cv:.3f}", ""]
        cells = [[name, *(f"{f(np.asarray(v, np.float64)):.3g}"
                          for f in (np.min, np.median, np.mean, np.max))] for name, v in rows]
        lines.append(markdown.table(["per client", "min", "median", "mean", "max"], cells))
        return "\n".join(lines)


def profile_partition(data: FederatedData, partition: str) -> DataProfile:
    """The profile of `data`'s clients (local train splits; test sizes alongside)."""
    counts = data.train_label_counts()
    train_sizes = counts.sum(axis=1)
    test_sizes = np.array([len(idx) for idx in data.test_indices])
    global_dist = counts.sum(axis=0) / max(counts.sum(), 1)
    kl = np.array([kl_divergence(c / max(c.sum(), 1), global_dist) for c in counts])
    return DataProfile(data.central.name, partition, counts, train_sizes, test_sizes,
                       global_dist, kl, (counts > 0).sum(axis=1),
                       coefficient_of_variation(train_sizes))
