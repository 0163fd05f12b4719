"""PNG figures (matplotlib, headless Agg backend): the package's one plotting set-up. Every
module that draws imports `plt` and `save` from here."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from fedjax_pfedes.data.profile import DataProfile  # noqa: E402


def label_heatmap(profile: DataProfile, path: str) -> str:
    """Clients x classes heat-map of each client's label shares (rows sum to 1)."""
    counts = profile.label_counts.astype(np.float64)
    shares = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    height = min(2.5 + 0.12 * profile.num_clients, 14)
    width = min(3.5 + 0.25 * profile.num_classes, 16)
    fig, ax = plt.subplots(figsize=(width, height))
    image = ax.imshow(shares, aspect="auto", interpolation="nearest", cmap="viridis",
                      vmin=0.0, vmax=max(float(shares.max()), 1e-9))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    ax.set_title(f"{profile.dataset} / {profile.partition}: label share per client")
    fig.colorbar(image, ax=ax, label="share of the client's train samples")
    return save(fig, path)


def size_histogram(profile: DataProfile, path: str) -> str:
    """Histogram of clients' local train sizes, with the coefficient of variation."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(profile.train_sizes, bins=min(30, max(profile.num_clients // 2, 5)),
            color="tab:blue", edgecolor="white")
    ax.set_xlabel("local train samples")
    ax.set_ylabel("clients")
    ax.set_title(f"{profile.dataset} / {profile.partition}: client sizes "
                 f"(CV {profile.size_cv:.2f})")
    return save(fig, path)


def save(fig, path: str, dpi: int = 110) -> str:
    """Writes `fig` (laid out tightly) to the PNG `path`, making its folder, and closes it.

    Args:
      fig: a matplotlib figure.
      path: the PNG file.
      dpi: its resolution.

    Returns:
      `path`.
    """
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
