"""Input statistics computed from the training pool (never hard-coded) and range detection.

Images may be stored in [0, 255] (uint8 from tensorflow-datasets) or in [0, 1] (floats); the
statistics are always reported in [0, 1] units, and `models.layers.InputNormalization` rescales
every example to [0, 1] before standardizing, for every client model and for E_proxy alike.
"""

from __future__ import annotations

import numpy as np

_EPS = 1e-6


def pixel_scale(x: np.ndarray) -> float:
    """255 for pixels stored in [0, 255] (any integer dtype, or floats above 1.5), else 1."""
    if np.issubdtype(x.dtype, np.integer):
        return 255.0
    return 255.0 if x.size and float(np.max(x)) > 1.5 else 1.0


def image_statistics(x: np.ndarray, chunk: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of images [N, H, W, C] in [0, 1] units.

    Accumulated in float64 over chunks of examples, so a 50,000-image uint8 pool is never copied
    to floats at once.
    """
    scale = pixel_scale(x)
    channels = x.shape[-1]
    total = np.zeros(channels)
    total_sq = np.zeros(channels)
    count = 0
    for start in range(0, len(x), chunk):
        block = x[start:start + chunk].reshape(-1, channels).astype(np.float64) / scale
        total += block.sum(axis=0)
        total_sq += np.square(block).sum(axis=0)
        count += block.shape[0]
    mean = total / max(count, 1)
    var = np.maximum(total_sq / max(count, 1) - np.square(mean), 0.0)
    return mean.astype(np.float32), (np.sqrt(var) + _EPS).astype(np.float32)


def tabular_statistics(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature mean and std of a [N, F] table in the features' own units."""
    x64 = x.astype(np.float64)
    return x64.mean(axis=0).astype(np.float32), (x64.std(axis=0) + _EPS).astype(np.float32)
