"""Running one client's function over a cohort: `vmap` under jit, or a loop of jitted calls.

Like FedJAX's `for_each_client`, this separates WHAT a client computes (written once, for one
client, in `CohortProgram`) from HOW a cohort runs it. Both strategies take the same inputs and
give the same numbers (up to float reassociation):

* 'vmap': one jitted call maps the client function over the round's participant slots. Slots are
  padded to a fixed bucket with an out-of-range index, so the shapes never change after round 1;
  padded slots read a real client's data (clipped gather) but their results are dropped on the
  scatter and carry zero aggregation weight.
* 'loop': one jitted call per real participant, which reads and writes its row of the stacked
  state in place (the state buffer is donated). Padded slots cost nothing.

Which one is faster depends on the models, the bucket and the backend (on CPU vmapped per-client
convolutions become grouped convolutions); 'auto' measures both per cohort at start-up
(`strategy_choice`), see benchmarks/execution_strategies.py for the side-by-side numbers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfedes.algorithms.base import CohortProgram, Metrics, PyTree

STRATEGIES = ("vmap", "loop")


def resolve_strategy(name: str) -> str:
    """Checks `config.execution.strategy`: 'loop', 'vmap', or 'auto' (chosen per cohort by
    timing both on the run's backend, see `strategy_choice`)."""
    if name == "auto" or name in STRATEGIES:
        return name
    raise ValueError(f"config.execution.strategy: unknown strategy '{name}'; "
                     f"known: ['auto', 'loop', 'vmap']")


def _take(tree: PyTree, idx: jax.Array) -> PyTree:
    return jax.tree.map(lambda a: jnp.take(a, idx, axis=0, mode="clip"), tree)


def _put(tree: PyTree, idx: jax.Array, rows: PyTree) -> PyTree:
    return jax.tree.map(lambda a, r: a.at[idx].set(r, mode="drop"), tree, rows)


@dataclasses.dataclass(frozen=True)
class CohortRunner:
    """Executes a cohort's `CohortProgram` with one strategy.

    update(broadcast, states, train, slots, keys) -> (uploads, states, metrics):
      `states` and `train` are stacked over the cohort's clients; `slots` [bucket] holds the local
      indices of this round's participants, padded with `num_clients` (out of range); `keys`
      [bucket] are the participants' RNG keys. Returned uploads and metrics are stacked over the
      bucket (zeros in padded slots); states of non-participants are unchanged.
    evaluate(broadcast, states, test, global_x, global_y) -> metrics stacked over all clients.
    evaluate_slots(broadcast, states, test, slots, global_x, global_y) -> metrics of the clients
      in `slots` only, stacked over the bucket (zeros in padded slots); the per-round monitoring
      (loss before / after aggregation) uses it.
    computed_steps(steps, bucket) -> local steps the hardware executed for a round whose real
      participants ran `steps` [participants] steps in `bucket` slots: their sum for 'loop'; for
      'vmap' every slot iterates until the longest schedule ends, bucket * max(steps).
    """

    strategy: str
    update: Callable[..., tuple[PyTree, PyTree, Metrics]]
    evaluate: Callable[..., Metrics]
    evaluate_slots: Callable[..., Metrics]
    computed_steps: Callable[[np.ndarray, int], float]


def make_runner(program: CohortProgram, strategy: str) -> CohortRunner:
    """Builds the jitted update/evaluate functions of a cohort for `strategy` ('vmap'|'loop')."""
    if strategy == "vmap":
        return _vmap_runner(program)
    if strategy == "loop":
        return _loop_runner(program)
    raise ValueError(f"make_runner: strategy must be 'loop' or 'vmap' ('auto' is resolved per "
                     f"cohort by strategy_choice), got '{strategy}'")


def _vmap_runner(program: CohortProgram) -> CohortRunner:
    @functools.partial(jax.jit, donate_argnums=1)
    def vmapped_update(broadcast, states, train, slots, keys):
        valid = slots < train.sizes.shape[0]
        rows = _take(train, slots)
        # Padded slots hold no samples, so they take no local steps (their results are dropped).
        rows = rows.replace(sizes=jnp.where(valid, rows.sizes, 0))
        uploads, new_rows, metrics = jax.vmap(program.client_update, in_axes=(None, 0, 0, 0))(
            broadcast, _take(states, slots), rows, keys)
        zero_padded = lambda a: jnp.where(valid.reshape((-1,) + (1,) * (a.ndim - 1)), a, 0)  # noqa: E731
        return (jax.tree.map(zero_padded, uploads), _put(states, slots, new_rows),
                jax.tree.map(zero_padded, metrics))

    @jax.jit
    def vmapped_evaluate(broadcast, states, test, global_x, global_y):
        return jax.vmap(program.evaluate, in_axes=(None, 0, 0, None, None))(
            broadcast, states, test, global_x, global_y)

    @jax.jit
    def vmapped_evaluate_slots(broadcast, states, test, slots, global_x, global_y):
        valid = slots < test.sizes.shape[0]
        metrics = jax.vmap(program.evaluate, in_axes=(None, 0, 0, None, None))(
            broadcast, _take(states, slots), _take(test, slots), global_x, global_y)
        return jax.tree.map(lambda a: jnp.where(valid, a, 0), metrics)

    def update(broadcast, states, train, slots, keys):
        return vmapped_update(broadcast, states, train, jnp.asarray(slots), keys)

    def evaluate_slots(broadcast, states, test, slots, global_x, global_y):
        return vmapped_evaluate_slots(broadcast, states, test, jnp.asarray(slots), global_x,
                                      global_y)

    def computed_steps(steps: np.ndarray, bucket: int) -> float:
        return float(bucket * np.max(steps)) if len(steps) else 0.0

    return CohortRunner("vmap", update, vmapped_evaluate, evaluate_slots, computed_steps)


def _loop_runner(program: CohortProgram) -> CohortRunner:
    """One jitted call per participant. Each call also writes the client's upload and metrics
    into row `j` of bucket-shaped output buffers (donated, updated in place), so a round runs
    no eager per-leaf stacking and nothing compiles after the first call."""

    # Traced once: the output shapes below and the jitted call share this trace.
    client_update = jax.jit(program.client_update)

    @functools.partial(jax.jit, donate_argnums=(1, 5, 6))
    def one_client_update(broadcast, states, train, i, key, uploads, metrics, j):
        upload, new_row, m = client_update(broadcast, _row(states, i), _row(train, i), key)
        return (_set_row(uploads, j, upload), _set_row(states, i, new_row),
                _set_row(metrics, j, m))

    @functools.partial(jax.jit, donate_argnums=6)
    def one_client_evaluate(broadcast, states, test, i, global_x, global_y, out, j):
        return _set_row(out, j, program.evaluate(broadcast, _row(states, i), _row(test, i),
                                                 global_x, global_y))

    shapes: dict[str, PyTree] = {}  # output shapes, traced once (they never change)

    def update_buffers(broadcast, states, train, keys, bucket):
        if "update" not in shapes:
            row = functools.partial(jax.eval_shape, lambda tree: _row(tree, 0))
            shapes["update"] = client_update.eval_shape(broadcast, row(states), row(train),
                                                        keys[0])
        uploads, _, metrics = shapes["update"]
        return _zeros_in_slots((uploads, metrics), bucket)

    def evaluate_buffer(broadcast, states, test, global_x, global_y, bucket):
        key = f"evaluate{global_x.shape}"
        if key not in shapes:
            shapes[key] = jax.eval_shape(
                lambda b, s, t, gx, gy: program.evaluate(b, _row(s, 0), _row(t, 0), gx, gy),
                broadcast, states, test, global_x, global_y)
        return _zeros_in_slots(shapes[key], bucket)

    def update(broadcast, states, train, slots, keys):
        slots = np.asarray(slots)
        uploads, metrics = update_buffers(broadcast, states, train, keys, len(slots))
        for j in np.flatnonzero(slots < train.sizes.shape[0]):
            uploads, states, metrics = one_client_update(
                broadcast, states, train, jnp.int32(slots[j]), keys[j], uploads, metrics,
                jnp.int32(j))
        return uploads, states, metrics

    def evaluate_slots(broadcast, states, test, slots, global_x, global_y):
        slots = np.asarray(slots)
        out = evaluate_buffer(broadcast, states, test, global_x, global_y, len(slots))
        for j in np.flatnonzero(slots < test.sizes.shape[0]):
            out = one_client_evaluate(broadcast, states, test, jnp.int32(slots[j]), global_x,
                                      global_y, out, jnp.int32(j))
        return out

    def evaluate(broadcast, states, test, global_x, global_y):
        every = np.arange(test.sizes.shape[0], dtype=np.int32)
        return evaluate_slots(broadcast, states, test, every, global_x, global_y)

    def computed_steps(steps: np.ndarray, bucket: int) -> float:
        del bucket  # padded slots are never called
        return float(np.sum(steps))

    return CohortRunner("loop", update, evaluate, evaluate_slots, computed_steps)


def _set_row(tree: PyTree, i: jax.Array, row: PyTree) -> PyTree:
    return jax.tree.map(lambda a, r: a.at[i].set(r), tree, row)


def _row(tree: PyTree, i: jax.Array) -> PyTree:
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _zeros(shape: tuple[int, ...], dtype) -> jax.Array:
    return jnp.zeros(shape, dtype)


def _zeros_in_slots(shapes: PyTree, bucket: int) -> PyTree:
    """Zeros [bucket, *shape] for every leaf of `shapes` (jitted per shape: compiled once)."""
    return jax.tree.map(lambda s: _zeros((bucket,) + tuple(s.shape), jnp.dtype(s.dtype)),
                        shapes)
