"""Feature-alignment losses between a client's projected features and the proxy's features.

pFedES as implemented here (`algorithms/pfedes/__init__.py`) aligns with mean-squared error or
negative cosine similarity; a contrastive (InfoNCE; van den Oord et al., 2018) variant is added.
Each returns the masked mean over the batch, `align(a, b, mask)`; which side carries a stop-gradient
is the caller's choice.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from fedjax_pfedes.algorithms.local_training import masked_mean
from fedjax_pfedes.errors import ConfigError

AlignLoss = Callable[[jnp.ndarray, jnp.ndarray, jnp.ndarray], jnp.ndarray]


def mse_alignment(a: jnp.ndarray, b: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    """Mean over examples of the mean squared difference over feature dimensions."""
    return masked_mean(jnp.mean((a - b) ** 2, axis=-1), mask)


def _normalize(v: jnp.ndarray) -> jnp.ndarray:
    return v / jnp.sqrt(jnp.sum(v * v, axis=-1, keepdims=True) + 1e-12)


def cosine_alignment(a: jnp.ndarray, b: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    """Negative cosine similarity, shifted by 1 so perfect alignment scores 0: 1 - cos(a, b)."""
    return masked_mean(1.0 - jnp.sum(_normalize(a) * _normalize(b), axis=-1), mask)


def make_contrastive_alignment(temperature: float) -> AlignLoss:
    """InfoNCE: example i of `a` must pick example i of `b` among the batch's real examples."""

    def contrastive_alignment(a, b, mask):
        sim = _normalize(a) @ _normalize(b).T / temperature
        sim = jnp.where(mask[None, :], sim, -1e9)
        log_prob = jnp.diagonal(sim) - jax.nn.logsumexp(sim, axis=-1)
        return masked_mean(-log_prob, mask)

    return contrastive_alignment


def get_alignment(name: str, temperature: float = 0.1) -> AlignLoss:
    """Alignment loss by config name: 'mse', 'cosine' or 'contrastive'."""
    if name == "mse":
        return mse_alignment
    if name == "cosine":
        return cosine_alignment
    if name == "contrastive":
        return make_contrastive_alignment(temperature)
    raise ConfigError(f"config.align: unknown alignment '{name}'; "
                     "known: ['contrastive', 'cosine', 'mse']")


def multi_scale(align: AlignLoss, weights: tuple[float, ...]) -> AlignLoss:
    """sum_s weights[s] * align(a[:, s], b[:, s], mask) over the scale axis of [B, S, d] features;
    with one weight, weights[0] * align(a, b, mask) on [B, d] features."""
    if len(weights) == 1:
        return lambda a, b, mask: weights[0] * align(a, b, mask)

    def aligned(a, b, mask):
        return sum(w * align(a[:, s], b[:, s], mask) for s, w in enumerate(weights))

    return aligned
