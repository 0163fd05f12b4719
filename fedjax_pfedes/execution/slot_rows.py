"""Rows of stacked per-client pytrees, and buckets of participant slots: the small programs
every execution strategy shares (read or write one client's row, zeros shaped like a bucket's
outputs, evaluating members a bucket at a time)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfedes.algorithms.base import Metrics, PyTree


def set_row(tree: PyTree, i: jax.Array, row: PyTree) -> PyTree:
    return jax.tree.map(lambda a, r: a.at[i].set(r), tree, row)


def get_row(tree: PyTree, i: jax.Array) -> PyTree:
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def row_shapes(tree: PyTree) -> PyTree:
    """The shapes of one row of `tree` (`get_row`'s), as `jax.ShapeDtypeStruct`s."""
    return jax.eval_shape(lambda t: get_row(t, 0), tree)


def row_bytes(tree: PyTree) -> int:
    """Bytes of one row of stacked `tree` (one client's state): what the cost model prices and
    the lanes and evaluation chunks budget per client.

    Args:
      tree: stacked arrays (or `jax.ShapeDtypeStruct`s), rows along axis 0.

    Returns:
      Bytes of one row, dense.
    """
    return sum(math.prod(a.shape[1:]) * np.dtype(a.dtype).itemsize
               for a in jax.tree.leaves(tree))


def zero_padded(tree: PyTree, valid: jax.Array) -> PyTree:
    """`tree`'s rows where `valid` (leading axes of its leaves), zeros of each leaf's dtype
    elsewhere (a bool stays a bool): padded slots' outputs."""
    return jax.tree.map(lambda a: jnp.where(
        valid.reshape(valid.shape + (1,) * (a.ndim - valid.ndim)), a,
        jnp.zeros((), a.dtype)), tree)


@functools.cache
def _zeros_program(treedef, leaves: tuple[tuple[tuple[int, ...], str], ...]) -> Callable:
    return jax.jit(lambda: jax.tree.unflatten(treedef, [jnp.zeros(shape, dtype)
                                                        for shape, dtype in leaves]))


def zeros_in_slots(shapes: PyTree, bucket: int) -> PyTree:
    """Zeros [bucket, *shape] for every leaf of `shapes`: one compiled program per tree of
    shapes (one per leaf shape compiled ~20 small programs in round 1 of the quick start)."""
    leaves, treedef = jax.tree.flatten(shapes)
    return _zeros_program(treedef, tuple(((bucket,) + tuple(s.shape), jnp.dtype(s.dtype).name)
                                         for s in leaves))()


def evaluate_in_buckets(evaluate_slots: Callable[..., Metrics], broadcast, states, test,
                        members: np.ndarray, bucket: int, global_x=None, global_y=None
                        ) -> dict[str, np.ndarray]:
    """Metrics of the cohort members `members` (local indices), host-side, computed `bucket`
    slots per `evaluate_slots` call (one compiled shape; the last call padded out of range)."""
    num_clients = test.sizes.shape[0]
    parts = []
    for start in range(0, len(members), bucket):
        chunk = members[start:start + bucket]
        slots = np.full(bucket, num_clients, np.int32)
        slots[:len(chunk)] = chunk
        m = jax.device_get(evaluate_slots(broadcast, states, test, slots, global_x, global_y))
        parts.append({k: np.asarray(v)[:len(chunk)] for k, v in m.items()})
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
