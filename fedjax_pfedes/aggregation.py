"""Server-side aggregation math: upload checks, sample-weighted mean, momentum smoothing.

This is the one place the averaging of uploads is written. Uploads arrive stacked per cohort
(leading axis = the cohort's participant slots, padded slots carry weight 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

PyTree = object


class UploadMismatchError(ValueError):
    """An upload whose tree structure, leaf shape or dtype differs from the global tree."""


def _leaf_name(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def check_upload(expected: PyTree, upload: PyTree, client: str, stacked: int | None = None
                 ) -> None:
    """Checks one upload (or a stack of `stacked` uploads) against the global tree.

    Args:
      expected: the global tree (e.g. the broadcast E_proxy parameters).
      upload: a client's upload; with `stacked=n`, n uploads stacked on a leading axis.
      client: how to name the sender(s) in the error, e.g. "client 7" or "clients [3, 9]".
      stacked: size of the leading client axis, or None for a single upload.

    Raises:
      UploadMismatchError: naming the client and the first offending leaf.
    """
    exp_leaves = dict(jax.tree_util.tree_flatten_with_path(expected)[0])
    got_leaves = dict(jax.tree_util.tree_flatten_with_path(upload)[0])
    exp_names = {_leaf_name(p): v for p, v in exp_leaves.items()}
    got_names = {_leaf_name(p): v for p, v in got_leaves.items()}
    missing = sorted(set(exp_names) - set(got_names))
    extra = sorted(set(got_names) - set(exp_names))
    if missing or extra:
        raise UploadMismatchError(
            f"upload of {client} does not match the global tree: missing leaves {missing}, "
            f"unexpected leaves {extra}")
    if jax.tree.structure(expected) != jax.tree.structure(upload):
        raise UploadMismatchError(f"upload of {client} has the global tree's leaves in a "
                                  f"different container structure: {jax.tree.structure(upload)}")
    lead = () if stacked is None else (stacked,)
    for name, ref in exp_names.items():
        got = got_names[name]
        want_shape = lead + tuple(np.shape(ref))
        if tuple(np.shape(got)) != want_shape:
            raise UploadMismatchError(f"upload of {client}: leaf '{name}' has shape "
                                      f"{tuple(np.shape(got))}, expected {want_shape}")
        if jnp.result_type(got) != jnp.result_type(ref):
            raise UploadMismatchError(f"upload of {client}: leaf '{name}' has dtype "
                                      f"{jnp.result_type(got)}, expected {jnp.result_type(ref)}")


def weighted_mean(groups: Sequence[tuple[PyTree, jnp.ndarray]]) -> tuple[PyTree, jnp.ndarray]:
    """Weighted mean of stacked uploads across groups, accumulated in float32.

    Args:
      groups: (stacked_uploads, weights) pairs; each stacked tree has a leading axis of the same
        length as its weights. Trees of all groups share one structure.

    Returns:
      (mean tree in float32, total weight). With total weight 0 the mean is all zeros. Finite
      uploads give a finite mean (no float32 overflow in the weighted sum).
    """
    total = sum(jnp.sum(w.astype(jnp.float32)) for _, w in groups)
    safe_total = jnp.where(total > 0, total, 1.0)

    def weighted_sum(uploads, w):
        w = w.astype(jnp.float32)
        return jax.tree.map(lambda u: jnp.tensordot(w, u.astype(jnp.float32), axes=1), uploads)

    def normalized_sum(uploads, w):  # convex weights: |mean| <= max |upload|, never overflows
        w = w.astype(jnp.float32) / safe_total
        return jax.tree.map(lambda u: jnp.tensordot(w, u.astype(jnp.float32), axes=1), uploads)

    sums = [weighted_sum(u, w) for u, w in groups]
    mean = jax.tree.map(lambda *xs: sum(xs) / safe_total, *sums)
    # sum(w x) / W overflows float32 for finite uploads near 3.4e38 (or weights x values beyond
    # it); sum((w / W) x) cannot. The first form stays where finite, so results do not move.
    fallback = [normalized_sum(u, w) for u, w in groups]
    mean = jax.tree.map(lambda m, *xs: jnp.where(jnp.isfinite(m), m, sum(xs)), mean, *fallback)
    return mean, total


def mean_over_cohorts(old: PyTree, groups) -> PyTree:
    """The weighted mean of every cohort's uploads of one shared tree (a model every client
    holds in the same shape), cast to `old`'s dtypes; `old` when nobody took part."""
    average, total = weighted_mean(list(groups.values()))
    return jax.tree.map(lambda a, o: jnp.where(total > 0, a.astype(o.dtype), o), average, old)


def momentum_smoothing(old: PyTree, average: PyTree, beta: float) -> PyTree:
    """Server momentum of the pFedES seed (section 3.3): new = beta * old + (1 - beta) * average."""
    return jax.tree.map(
        lambda o, a: (beta * o.astype(jnp.float32) + (1.0 - beta) * a).astype(o.dtype),
        old, average)


def client_weights(sample_counts: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    """Aggregation weight of each participant slot: its local sample count, 0 for padding."""
    return jnp.where(mask, sample_counts.astype(jnp.float32), 0.0)


def class_weighted_mean(groups: Sequence[tuple[jax.Array, jax.Array, jax.Array]]
                        ) -> tuple[jax.Array, jax.Array]:
    """Per-class mean of uploaded class statistics, weighted by per-class sample counts.

    Args:
      groups: per cohort (values [slots, classes, d], counts [slots, classes], client weights
        [slots]); a client's weight multiplies its counts (0 drops a padded slot).

    Returns:
      (mean [classes, d], total count [classes]); classes nobody holds get a zero mean.
    """
    numerator, total = None, None
    for values, counts, weights in groups:
        c = counts.astype(jnp.float32) * (weights > 0).astype(jnp.float32)[:, None]
        num = jnp.einsum("kc,kcd->cd", c, values.astype(jnp.float32))
        den = c.sum(axis=0)
        numerator = num if numerator is None else numerator + num
        total = den if total is None else total + den
    return numerator / jnp.maximum(total, 1e-12)[:, None], total
