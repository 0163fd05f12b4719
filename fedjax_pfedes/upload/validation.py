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


def norm_outliers(norms: np.ndarray, valid: np.ndarray, factor: float) -> np.ndarray:
    """[slots] True where a valid slot's norm exceeds `factor` x the median norm of the valid
    slots (never flags anything with fewer than 3 valid slots: no meaningful median).

    On the host, in float32 as `masked_median` computes it on the device (the same values:
    the rule runs every round, where a handful of eager device calls cost more than it).

    Args:
      norms: [slots] the norms (per local sample, as the stage passes them).
      valid: [slots] which slots count.
      factor: the rule's factor.

    Returns:
      [slots] bool.
    """
    norms = np.asarray(norms, np.float32)
    valid = np.asarray(valid, bool)
    n = int(valid.sum())
    ordered = np.sort(np.where(valid, norms, np.finfo(np.float32).max))
    if n > 0:
        median = np.float32(0.5) * (ordered[max((n - 1) // 2, 0)] + ordered[n // 2])
    else:
        median = np.float32(0.0)
    return valid & (n >= 3) & (norms > np.float32(factor) * median)


def masked_median(values: jax.Array, valid: jax.Array) -> jax.Array:
    """Median over axis 0 of `values` [slots, ...] among the valid slots (0 when none is)."""
    big = jnp.finfo(jnp.float32).max
    shape = (-1,) + (1,) * (values.ndim - 1)
    ordered = jnp.sort(jnp.where(valid.reshape(shape), values.astype(jnp.float32), big), axis=0)
    n = jnp.sum(valid)
    lo = jnp.take(ordered, jnp.maximum((n - 1) // 2, 0), axis=0)
    hi = jnp.take(ordered, jnp.maximum(n // 2, 0), axis=0)
    return jnp.where(n > 0, 0.5 * (lo + hi), 0.0)
