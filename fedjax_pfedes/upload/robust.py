"""Aggregation weights and robust aggregators over stacked client updates.

- Weight smoothing: sample counts (FedAvg), their square root, or uniform.
- Coordinate-wise median and coordinate-wise trimmed mean (Yin et al., "Byzantine-Robust
  Distributed Learning: Towards Optimal Statistical Rates", ICML 2018): per coordinate over the
  valid clients, unweighted (a sample count would let one client buy the median).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fedjax_pfedes import aggregation
from fedjax_pfedes.config.upload_sections import WEIGHTINGS
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.upload.validation import masked_median


@functools.partial(jax.jit, static_argnums=2)
def smooth_weights(sample_counts: jax.Array, valid: jax.Array, weighting: str) -> jax.Array:
    """Aggregation weight per slot: counts, sqrt(counts) or 1; 0 for invalid slots
    ('all_samples' weighs the counts it is given: `stages.Weighting` passes training + local
    test)."""
    if weighting in ("samples", "all_samples"):  # FedAvg's weights, once in aggregation.py
        return aggregation.client_weights(sample_counts, valid)
    counts = sample_counts.astype(jnp.float32)
    if weighting == "sqrt_samples":
        w = jnp.sqrt(counts)
    elif weighting == "uniform":
        w = jnp.ones_like(counts)
    else:
        raise ConfigError(f"config.upload.weighting must be one of {WEIGHTINGS}, got "
                         f"'{weighting}'")
    return jnp.where(valid, w, 0.0)


def coordinate_median(stacked, valid: jax.Array):
    """Per-coordinate median over the valid slots of each leaf [slots, ...]."""
    return jax.tree.map(lambda a: masked_median(a, valid), stacked)


# Robust aggregators need this many valid uploads to differ from a mean of what arrived; with
# fewer, the pipeline skips the scope's update for the round and says so.
MIN_ROBUST_UPLOADS = 3


def trim_count(n: jax.Array, trim_fraction: float) -> jax.Array:
    """Values cut at each end among n: floor(trim_fraction * n), but at least 1 whenever
    trim_fraction > 0 (floor(0.1 * 9) = 0 would silently be a plain mean), and never so many
    that nothing is left."""
    k = jnp.floor(trim_fraction * n).astype(jnp.int32)
    if trim_fraction > 0:
        k = jnp.maximum(k, 1)
    return jnp.clip(k, 0, jnp.maximum((n - 1) // 2, 0))


def trimmed_mean(stacked, valid: jax.Array, trim_fraction: float):
    """Per coordinate: drop the `trim_count(n, trim_fraction)` largest and smallest of the n
    valid values, average the rest."""
    if not 0 <= trim_fraction < 0.5:
        raise ConfigError(f"config.upload.trim_fraction must be in [0, 0.5), got {trim_fraction}")
    n = jnp.sum(valid)
    k = trim_count(n, trim_fraction)
    big = jnp.finfo(jnp.float32).max

    def one(a):
        shape = (-1,) + (1,) * (a.ndim - 1)
        ordered = jnp.sort(jnp.where(valid.reshape(shape), a.astype(jnp.float32), big), axis=0)
        rank = jnp.arange(a.shape[0]).reshape(shape)
        keep = (rank >= k) & (rank < n - k)
        count = jnp.maximum(n - 2 * k, 1)
        return jnp.sum(jnp.where(keep, ordered, 0.0), axis=0) / count

    return jax.tree.map(one, stacked)
