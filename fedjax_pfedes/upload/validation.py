"""Checks on uploads before they are aggregated: model fingerprints, non-finite values, norm
outliers. A failed check rejects the client (weight 0) instead of stopping the round."""

from __future__ import annotations

import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np


def fingerprint(tree, leading_axes: int = 0) -> str:
    """SHA-256 over the sorted (leaf path, shape, dtype) of `tree`: which model an upload is for.

    `leading_axes` leading dimensions of every leaf (e.g. the stacked client axis) are ignored.
    Two trees have the same fingerprint iff they have the same leaf names, shapes and dtypes.
    """
    entries = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        shape = tuple(np.shape(leaf))[leading_axes:]
        entries.append(f"{name}:{shape}:{jnp.result_type(leaf)}")
    return hashlib.sha256("\n".join(sorted(entries)).encode()).hexdigest()


@jax.jit
def finite_mask(stacked) -> jax.Array:
    """[slots] True where every value of the slot's upload is finite."""
    leaves = jax.tree.leaves(stacked)
    if not leaves:
        raise ValueError("finite_mask: the upload tree has no leaves")
    flags = [jnp.all(jnp.isfinite(a.reshape(a.shape[0], -1)), axis=1) for a in leaves]
    return jnp.stack(flags).all(axis=0)


def all_finite(tree) -> jax.Array:
    """Whether every value of ONE client's update `tree` is finite. Its sum of squares is
    finite only if every value is (NaN and Inf propagate), so that one reduction, the same one
    `update_norms` makes (computed once where both are asked for), decides the common case;
    only when it is not finite (a non-finite value, or squares past float32's range) does the
    exact check run (`finite_mask`)."""
    one = jax.tree.map(lambda a: a[None], tree)
    return jax.lax.cond(jnp.isfinite(update_norms(one)[0]), lambda: jnp.bool_(True),
                        lambda: finite_mask(one)[0])


def update_norms(deltas) -> jax.Array:
    """[slots] global L2 norm of each slot's update (non-finite slots give inf/nan)."""
    leaves = jax.tree.leaves(deltas)
    sq = sum(jnp.sum(a.reshape(a.shape[0], -1).astype(jnp.float32) ** 2, axis=1)
             for a in leaves)
    return jnp.sqrt(sq)


def model_part(tree, keys: tuple[str, ...]):
    """The top-level entries `keys` of an upload (its model part, `Algorithm.norm_keys`); the
    whole tree when `keys` is empty."""
    return {k: tree[k] for k in keys} if keys else tree


def upload_norm(upload, template, keys: tuple[str, ...] = ()) -> jax.Array:
    """L2 norm of ONE client's upload minus `template`, over the entries `keys` only when
    given (`model_part`)."""
    return update_norms(jax.tree.map(
        lambda u, t: (u.astype(jnp.float32) - t.astype(jnp.float32))[None],
        model_part(upload, keys), model_part(template, keys)))[0]


@functools.partial(jax.jit, static_argnums=2)
def upload_norms(stacked, template, keys: tuple[str, ...] = ()) -> jax.Array:
    """[slots] `upload_norm` of each slot (one compiled call). One slot at a time (`lax.map`):
    XLA:CPU reduces the whole stack at once several times slower (docs/performance.md)."""
    return jax.lax.map(lambda upload: upload_norm(upload, template, keys), stacked)


def _valid_median(values: np.ndarray, valid: np.ndarray) -> np.float32:
    """The median of the valid values in float32, as `masked_median` computes it on the
    device (0 when none is valid)."""
    n = int(valid.sum())
    if n == 0:
        return np.float32(0.0)
    ordered = np.sort(np.where(valid, values, np.finfo(np.float32).max))
    return np.float32(0.5) * (ordered[max((n - 1) // 2, 0)] + ordered[n // 2])


def robust_log_z(norms: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """[slots] how many robust standard deviations each log-norm lies above the valid slots'
    median log-norm: (log x - median) / (1.4826 x MAD), the MAD scaled to a normal's standard
    deviation (Iglewicz & Hoaglin, 1993). Where the MAD is 0 (most norms equal) every norm above
    the median is +inf (only the factor then decides). A norm of 0 counts as the smallest
    positive float32."""
    logs = np.log(np.maximum(np.asarray(norms, np.float32), np.finfo(np.float32).tiny))
    valid = np.asarray(valid, bool)
    center = _valid_median(logs, valid)
    mad = _valid_median(np.abs(logs - center), valid)
    if mad > 0:
        return (logs - center) / (np.float32(1.4826) * mad)
    return np.where(logs > center, np.float32(np.inf), np.float32(0.0))


def norm_outliers(norms: np.ndarray, valid: np.ndarray, factor: float,
                  z_threshold: float = 0.0, hard_factor: float = 0.0,
                  relative: np.ndarray | None = None, model_ratio: float = 0.0) -> np.ndarray:
    """[slots] True where a valid slot's norm exceeds `factor` x the median norm of the valid
    slots and (when `z_threshold` > 0) its log-norm lies more than `z_threshold` robust
    standard deviations above their median log-norm (`robust_log_z`), or (when `hard_factor` >
    0) where it exceeds `hard_factor` x the median whatever the spread; and in every case
    (when `model_ratio` > 0) only where the update is larger than `model_ratio` x the norm of
    the model it updates (`relative`). Never flags anything with fewer than 3 valid slots (no
    meaningful median).

    The factor keeps a round of like-sized updates from rejecting an honest 2x one (a tiny MAD
    makes every z large); the z-score keeps a round whose honest norms spread over orders of
    magnitude from rejecting its largest honest ones (a 10x-median rule alone rejected ~4 % of
    the published pFedES's honest uploads; docs/threat_model.md); the hard factor still
    rejects a boosted update in such a round, where its z can stay small. Late in training
    most honest updates can shrink to a common floor while a few clients still learn: the
    round's median then says nothing of their scale (honest norms 500x the median at a z of 57
    were measured), and the model's own norm does: an update smaller than the model it changes
    cannot replace it, and the boosted and model-replacement updates of the threat model are
    several times larger than the model.

    On the host, in float32 as `masked_median` computes it on the device (the same values:
    the rule runs every round, where a handful of eager device calls cost more than it).

    Args:
      norms: [slots] the norms (per local sample, as the stage passes them).
      valid: [slots] which slots count.
      factor: the rule's factor.
      z_threshold: the robust z-score a flagged norm must also exceed (0 = not applied).
      hard_factor: beyond this many medians a norm is flagged whatever its z (0 = none).
      relative: [slots] each update's norm over the norm of the model it updates (inf where
        the reference is all zeros: statistics, not a model).
      model_ratio: the `relative` a flagged update must also exceed (0 = not applied).

    Returns:
      [slots] bool.
    """
    norms = np.asarray(norms, np.float32)
    valid = np.asarray(valid, bool)
    n = int(valid.sum())
    median = _valid_median(norms, valid)
    out = valid & (n >= 3) & (norms > np.float32(factor) * median)
    if z_threshold > 0 and out.any():
        beyond = robust_log_z(norms, valid) > np.float32(z_threshold)
        if hard_factor > 0:
            beyond |= norms > np.float32(hard_factor) * median
        out &= beyond
    if model_ratio > 0 and relative is not None and out.any():
        out &= np.asarray(relative, np.float32) > np.float32(model_ratio)
    return out


def model_norm(template, keys: tuple[str, ...] = ()) -> float:
    """The L2 norm of the model part (`keys`) of an upload template: the model an update
    changes (0 for a template of zeros: uploads that are statistics)."""
    leaves = jax.tree.leaves(model_part(template, keys))
    if not leaves:
        return 0.0
    return float(update_norms(jax.tree.map(lambda a: a[None], model_part(template, keys)))[0])


def masked_median(values: jax.Array, valid: jax.Array) -> jax.Array:
    """Median over axis 0 of `values` [slots, ...] among the valid slots (0 when none is)."""
    big = jnp.finfo(jnp.float32).max
    shape = (-1,) + (1,) * (values.ndim - 1)
    ordered = jnp.sort(jnp.where(valid.reshape(shape), values.astype(jnp.float32), big), axis=0)
    n = jnp.sum(valid)
    lo = jnp.take(ordered, jnp.maximum((n - 1) // 2, 0), axis=0)
    hi = jnp.take(ordered, jnp.maximum(n // 2, 0), axis=0)
    return jnp.where(n > 0, 0.5 * (lo + hi), 0.0)
