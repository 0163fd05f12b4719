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

On CPU the loop is faster for convolutional models (vmapped per-client kernels become grouped
convolutions); on GPU/TPU batching clients is expected to win. `default_strategy` encodes the
measurement in benchmarks/execution_strategies.py.
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


def default_strategy(platform: str | None = None) -> str:
    """'loop' on CPU, 'vmap' on accelerators (see benchmarks/execution_strategies.py)."""
    platform = platform or jax.default_backend()
    return "loop" if platform == "cpu" else "vmap"


def resolve_strategy(name: str) -> str:
    if name == "auto":
        return default_strategy()
    if name not in STRATEGIES:
        raise ValueError(f"config.execution.strategy: unknown strategy '{name}'; "
                         f"known: ['auto', 'loop', 'vmap']")
    return name


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
    """

    strategy: str
    update: Callable[..., tuple[PyTree, PyTree, Metrics]]
    evaluate: Callable[..., Metrics]
    evaluate_slots: Callable[..., Metrics]


def make_runner(program: CohortProgram, strategy: str) -> CohortRunner:
    """Builds the jitted update/evaluate functions of a cohort for `strategy` ('vmap'|'loop')."""
    strategy = resolve_strategy(strategy)
    if strategy == "vmap":
        return _vmap_runner(program)
    return _loop_runner(program)


def _vmap_runner(program: CohortProgram) -> CohortRunner:
    @functools.partial(jax.jit, donate_argnums=1)
    def vmapped_update(broadcast, states, train, slots, keys):
        valid = slots < train.sizes.shape[0]
        uploads, new_rows, metrics = jax.vmap(program.client_update, in_axes=(None, 0, 0, 0))(
            broadcast, _take(states, slots), _take(train, slots), keys)
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

    return CohortRunner("vmap", update, vmapped_evaluate, evaluate_slots)


def _loop_runner(program: CohortProgram) -> CohortRunner:
    @functools.partial(jax.jit, donate_argnums=1)
    def one_client_update(broadcast, states, train, i, key):
        upload, new_row, metrics = program.client_update(
            broadcast, _row(states, i), _row(train, i), key)
        return upload, jax.tree.map(lambda a, r: a.at[i].set(r), states, new_row), metrics

    @jax.jit
    def one_client_evaluate(broadcast, states, test, i, global_x, global_y):
        return program.evaluate(broadcast, _row(states, i), _row(test, i), global_x, global_y)

    def update(broadcast, states, train, slots, keys):
        slots = np.asarray(slots)
        num_clients = train.sizes.shape[0]
        outputs = []
        for j in np.flatnonzero(slots < num_clients):
            upload, states, metrics = one_client_update(broadcast, states, train,
                                                        jnp.int32(slots[j]), keys[j])
            outputs.append((int(j), upload, metrics))
        if not outputs:
            shapes = jax.eval_shape(one_client_update, broadcast, states, train, jnp.int32(0),
                                    keys[0])
            return (_zeros_in_slots(shapes[0], len(slots)), states,
                    _zeros_in_slots(shapes[2], len(slots)))
        uploads, metrics = _stack_into_slots(outputs, len(slots))
        return uploads, states, metrics

    def evaluate(broadcast, states, test, global_x, global_y):
        rows = [one_client_evaluate(broadcast, states, test, jnp.int32(i), global_x, global_y)
                for i in range(test.sizes.shape[0])]
        return jax.tree.map(lambda *r: jnp.stack(r), *rows)

    def evaluate_slots(broadcast, states, test, slots, global_x, global_y):
        slots = np.asarray(slots)
        outputs = [(int(j), None, one_client_evaluate(broadcast, states, test,
                                                      jnp.int32(slots[j]), global_x, global_y))
                   for j in np.flatnonzero(slots < test.sizes.shape[0])]
        if not outputs:
            shapes = jax.eval_shape(one_client_evaluate, broadcast, states, test, jnp.int32(0),
                                    global_x, global_y)
            return _zeros_in_slots(shapes, len(slots))
        return _stack_into_slots(outputs, len(slots))[1]

    return CohortRunner("loop", update, evaluate, evaluate_slots)


def _row(tree: PyTree, i: jax.Array) -> PyTree:
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _stack_into_slots(outputs: list[tuple[int, PyTree, Metrics]], bucket: int
                      ) -> tuple[PyTree, Metrics]:
    """Stacks per-participant outputs into `bucket` slots, zeros where no participant ran."""
    positions = np.array([j for j, _, _ in outputs])

    def place(*rows):
        stacked = jnp.stack(rows)
        full = jnp.zeros((bucket,) + stacked.shape[1:], stacked.dtype)
        return full.at[positions].set(stacked)

    uploads = (jax.tree.map(place, *[u for _, u, _ in outputs]) if outputs[0][1] is not None
               else None)
    metrics = jax.tree.map(place, *[m for _, _, m in outputs])
    return uploads, metrics


def _zeros_in_slots(shapes: PyTree, bucket: int) -> PyTree:
    return jax.tree.map(lambda s: jnp.zeros((bucket,) + tuple(s.shape), s.dtype), shapes)
