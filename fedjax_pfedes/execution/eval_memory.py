"""How many clients one vectorized evaluation call may hold ('vmap' and 'shard').

Those strategies evaluate a cohort's clients in one mapped call: every client's local test set
and its scores on the global test set (`global_accuracy`, up to `GLOBAL_BATCH` samples per
client at a time) are alive together. For a large cohort of a convolutional model that is more
memory than the machine has, so the clients are evaluated in chunks whose estimated memory fits
`config.execution.eval_memory_budget_gb`; each client's numbers do not depend on the chunk.

The estimate is an upper bound read from the program itself: the bytes of every intermediate
value in the jaxpr of one client scoring one sample (`activation_bytes_per_row`, nested calls
included), times the rows a client scores at once, plus the client's state.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr

from fedjax_pfedes.algorithms.base import GLOBAL_BATCH, CohortProgram, PyTree
from fedjax_pfedes.execution.slot_rows import row_bytes

# The budget of `runners.make_runner` when none is given (`config.execution.eval_memory_budget_gb`
# has the same default).
DEFAULT_BUDGET_GB = 4.0


def _jaxprs(params: dict):
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, Jaxpr):
                yield item


def _outvar_bytes(jaxpr) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            aval = getattr(v, "aval", None)
            if aval is not None and hasattr(aval, "shape"):
                total += math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
        total += sum(_outvar_bytes(inner) for inner in _jaxprs(eqn.params))
    return total


def _abstract(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def activation_bytes_per_row(program: CohortProgram, broadcast: PyTree, state_row: PyTree,
                             x_row: PyTree) -> int:
    """Bytes of every intermediate value of `program.predict` scoring one sample `x_row`
    (shape [1, ...]) for one client (`state_row`): an upper bound on the activation memory a
    scored sample needs (XLA fuses and frees some of them)."""
    jaxpr = jax.make_jaxpr(program.predict)(*_abstract((broadcast, state_row, x_row)))
    return max(_outvar_bytes(jaxpr.jaxpr), 1)


def clients_per_call(program: CohortProgram, broadcast: PyTree, states: PyTree, test,
                     global_rows: int, budget_bytes: float, multiple: int = 1) -> int:
    """How many of the cohort's clients one mapped evaluation call may take: as many as fit
    `budget_bytes` (rows each: the local test width plus `global_rows` global samples, at most
    `GLOBAL_BATCH`, at `activation_bytes_per_row`, plus the client's state), a multiple of
    `multiple` (the mesh's devices), at least `multiple`.

    Args:
      program: the cohort's per-client functions.
      broadcast: what the server sends the cohort.
      states: the cohort's stacked client states ([clients, ...] leaves).
      test: the cohort's stacked local test data (`x` [clients, width, ...]).
      global_rows: global test samples scored per client (0: no global accuracy).
      budget_bytes: the memory one call may take.
      multiple: the call's client count must be a multiple of it.

    Returns:
      The number of clients per call.
    """
    state_row = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), states)
    x_row = jax.ShapeDtypeStruct((1,) + tuple(test.x.shape[2:]), test.x.dtype)
    per_row = activation_bytes_per_row(program, broadcast, state_row, x_row)
    rows = test.x.shape[1] + min(global_rows, GLOBAL_BATCH)
    fits = int(budget_bytes // (rows * per_row + row_bytes(states)))
    return max(multiple, fits // multiple * multiple)
