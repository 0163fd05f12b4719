"""The 'vmap' strategy: one jitted call maps the client function over all of a round's
participant slots. `mapped_runner` is also the 'shard' strategy's, with the slots split over a
device mesh (`strategies.sharded`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fedjax_pfedes.algorithms.base import CohortProgram, global_accuracy
from fedjax_pfedes.execution import eval_memory
from fedjax_pfedes.execution.placement import client_rows, local_copy, replicated, row_spec
from fedjax_pfedes.execution.slot_rows import zero_padded
from fedjax_pfedes.execution.strategies.protocol import (
    CohortRunner,
    Strategy,
    refuse_reducer,
    register_strategy,
)
from fedjax_pfedes.tree_util import put_rows, take_rows


def _vmapped(fn: Callable, in_axes: tuple) -> Callable:
    return jax.vmap(fn, in_axes=in_axes)


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Where 'shard' puts a call's arrays (`mapped_runner`); every method is the identity
    without a mesh ('vmap'). The cohort's samples and stacked states live on the mesh, split by
    client where `row_spec` allows (put there once, `engine.build.build_context`); a broadcast,
    the sizes and this round's slots are replicated per call; uploads and metrics go back to the
    default device, where the server step runs."""

    mesh: Mesh | None

    def on_mesh(self, tree):
        """Replicated over the mesh."""
        return tree if self.mesh is None else replicated(tree, mesh=self.mesh)

    def rows_on_mesh(self, tree):
        """Split by client (rows) over the mesh."""
        return tree if self.mesh is None else client_rows(tree, mesh=self.mesh)

    def data_on_mesh(self, data):
        """A cohort's samples split by client, their sizes replicated."""
        if self.mesh is None:
            return data
        return self.on_mesh(data.replace(x=self.rows_on_mesh(data.x),
                                         y=self.rows_on_mesh(data.y)))

    def home(self, tree):
        """Back on the default device."""
        return tree if self.mesh is None else local_copy(tree)

    def kept(self, tree):
        """Inside the program: the updated states keep their placement (split by client where
        `row_spec` says so)."""
        if self.mesh is None:
            return tree
        return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(
            a, NamedSharding(self.mesh, row_spec(a.shape, self.mesh))), tree)

    def gathered(self, tree):
        """Inside the program: over several processes the slots' results must reach every
        process: gathered (replicated on the mesh), then each process takes its local copy."""
        if self.mesh is None or jax.process_count() == 1:
            return tree
        return jax.lax.with_sharding_constraint(tree, NamedSharding(self.mesh, P()))


def mapped_runner(program: CohortProgram, name: str, map_clients: Callable,
                   mesh: Mesh | None = None, jit: Callable = jax.jit,
                   eval_budget_bytes: float = eval_memory.DEFAULT_BUDGET_GB * 2**30
                   ) -> CohortRunner:
    """'vmap' and 'shard': one jitted call maps the client function over all slots;
    `map_clients(fn, in_axes)` says how (plain vmap, or vmap per device under shard_map).
    `jit`: `jax.jit` with the client programs' compiler options (`kernel_options`).
    Evaluation maps over as many clients per call as `eval_budget_bytes` allows
    (`eval_memory.clients_per_call`): all of them in one call when they fit."""
    client_update = map_clients(program.client_update, (None, 0, 0, 0))
    client_evaluate = map_clients(program.evaluate, (None, 0, 0))
    client_global = map_clients(functools.partial(global_accuracy, program), (None, 0, None, None))
    place = _Placement(mesh)

    @functools.partial(jit, donate_argnums=1)
    def mapped_update(broadcast, states, train, slots, keys):
        valid = slots < train.sizes.shape[0]
        rows = take_rows(train, slots)
        # Padded slots hold no samples, so they take no local steps (their results are dropped).
        rows = rows.replace(sizes=jnp.where(valid, rows.sizes, 0))
        uploads, new_rows, metrics = client_update(broadcast, take_rows(states, slots), rows, keys)
        return (place.gathered(zero_padded(uploads, valid)),
                place.kept(put_rows(states, slots, new_rows)),
                place.gathered(zero_padded(metrics, valid)))

    @jit
    def mapped_evaluate_slots(broadcast, states, test, slots):
        valid = slots < test.sizes.shape[0]
        metrics = client_evaluate(broadcast, take_rows(states, slots), take_rows(test, slots))
        return place.gathered(jax.tree.map(lambda a: jnp.where(valid, a, 0), metrics))

    @jit
    def mapped_global_slots(broadcast, states, sizes, slots, global_x, global_y):
        valid = slots < sizes.shape[0]
        accuracy = client_global(broadcast, take_rows(states, slots), global_x, global_y)
        return place.gathered(jnp.where(valid, accuracy, 0))

    def update(broadcast, states, train, slots, keys):
        refuse_reducer(broadcast, name)
        uploads, states, metrics = mapped_update(
            place.on_mesh(broadcast), place.rows_on_mesh(states), place.data_on_mesh(train),
            place.on_mesh(jnp.asarray(slots)), place.on_mesh(keys))
        return place.home(uploads), states, place.home(metrics)

    def evaluate_slots(broadcast, states, test, slots, global_x=None, global_y=None):
        broadcast, states = place.on_mesh(broadcast), place.rows_on_mesh(states)
        slots = place.on_mesh(jnp.asarray(slots))
        metrics = place.home(mapped_evaluate_slots(broadcast, states, place.data_on_mesh(test),
                                                   slots))
        if global_x is None:
            return metrics
        global_accuracy = mapped_global_slots(broadcast, states, place.on_mesh(test.sizes), slots,
                                              *place.on_mesh((global_x, global_y)))
        return {**metrics, "global_accuracy": place.home(global_accuracy)}

    def computed_steps(steps: np.ndarray, bucket: int) -> float:
        return float(bucket * np.max(steps)) if len(steps) else 0.0

    evaluate = _evaluating_in_calls(program, evaluate_slots, mesh, eval_budget_bytes)
    return CohortRunner(name, update, evaluate, evaluate_slots, computed_steps)


def _evaluating_in_calls(program: CohortProgram, evaluate_slots: Callable, mesh: Mesh | None,
                         budget_bytes: float) -> Callable:
    """`CohortRunner.evaluate` of 'vmap' and 'shard': every client of the cohort through
    `evaluate_slots`, as many per call as `budget_bytes` allows (`eval_memory.clients_per_call`;
    a multiple of the mesh's devices)."""
    widths: dict = {}  # per shapes of the evaluation: clients per call

    def evaluate(broadcast, states, test, global_x=None, global_y=None):
        n = test.sizes.shape[0]
        multiple = 1 if mesh is None else mesh.size  # shard_map splits the slots evenly
        padded = -(-n // multiple) * multiple  # slots past n are out of range: zeros
        global_rows = 0 if global_x is None else int(global_x.shape[0])
        key = (jax.tree.structure(states), tuple(test.x.shape), global_rows,
               tuple(np.shape(a) for a in jax.tree.leaves(broadcast)))
        if key not in widths:
            widths[key] = eval_memory.clients_per_call(program, broadcast, states, test,
                                                       global_rows, budget_bytes,
                                                       multiple)
        width = min(widths[key], padded)
        outs = [evaluate_slots(broadcast, states, test,
                               np.arange(start, start + width, dtype=np.int32), global_x,
                               global_y) for start in range(0, n, width)]
        out = outs[0] if len(outs) == 1 else jax.tree.map(
            lambda *parts: jnp.concatenate(parts), *outs)
        return out if len(outs) * width == n else jax.tree.map(lambda a: a[:n], out)

    return evaluate


register_strategy(Strategy("vmap", lambda program, o: mapped_runner(
    program, "vmap", _vmapped, jit=o.jit, eval_budget_bytes=o.eval_budget_bytes),
    cost="longest_schedule"))
