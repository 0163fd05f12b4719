"""Pytree helpers every layer uses (a leaf: imports only JAX and NumPy)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def tree_size(tree) -> tuple[int, int]:
    """The size of a pytree of arrays, dense.

    Args:
      tree: arrays or `jax.ShapeDtypeStruct`s.

    Returns:
      (number of parameters, bytes).
    """
    leaves = jax.tree.leaves(tree)
    return (sum(int(np.prod(np.shape(x))) for x in leaves),
            sum(int(np.prod(np.shape(x))) * jnp.dtype(x.dtype).itemsize for x in leaves))


def take_rows(tree, rows: jax.Array):
    """Rows `rows` of every leaf's leading axis; an out-of-range row reads the last one.

    Args:
      tree: a pytree of stacked arrays [n, ...].
      rows: integer row indices.

    Returns:
      The pytree with leaves [len(rows), ...].
    """
    return jax.tree.map(lambda a: jnp.take(a, rows, axis=0, mode="clip"), tree)


def put_rows(tree, rows: jax.Array, values):
    """`tree` with rows `rows` of every leaf replaced by `values`' rows; out-of-range rows
    (padding, skipped clients) are dropped.

    Args:
      tree: a pytree of stacked arrays [n, ...].
      rows: integer row indices.
      values: a pytree like `tree` with leaves [len(rows), ...].

    Returns:
      The updated pytree (a new value; `tree` is not modified).
    """
    return jax.tree.map(lambda a, r: a.at[rows].set(r, mode="drop"), tree, values)
