"""The 'loop' strategy: one jitted call per real participant, reading and writing its row of the
stacked state in place; with several host threads, the participants split over them."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfedes.algorithms.base import CohortProgram, global_accuracy
from fedjax_pfedes.execution.host_threads import ClientThreads
from fedjax_pfedes.execution.slot_rows import get_row, row_shapes, set_row, zeros_in_slots
from fedjax_pfedes.execution.strategies.protocol import (
    CohortRunner,
    Finishing,
    Strategy,
    evaluating_every_client,
    refuse_reducer,
    register_strategy,
)


def _loop_runner(program: CohortProgram, threads: int = 1, jit: Callable = jax.jit
                 ) -> CohortRunner:
    """One jitted call per participant. Each training call also writes the client's upload and
    metrics into row `j` of bucket-shaped output buffers (donated, updated in place), so a round
    runs no eager per-leaf stacking and nothing compiles after the first call. Evaluation calls
    return one client's metrics (and, given a global test set, its `global_accuracy` from a
    second program), written into the bucket by a small donated call: the monitoring of a
    round's participants and the evaluation of every client then share one compiled program.

    With `threads` > 1 the participants are split over host threads (`ClientThreads`: each
    takes the next participant, the most samples first); each thread's calls return the
    client's outputs, which the calling thread then writes into the bucket and the state rows
    (one small donated call each). Every client computes the same function of the same inputs,
    so the numbers are those of one thread.
    `jit`: `jax.jit` with the client programs' compiler options (`kernel_options`)."""
    pool = ClientThreads(threads, "loop_client") if threads > 1 else None
    evaluate_slots = _looped_evaluation(program, jit, pool)

    def computed_steps(steps: np.ndarray, bucket: int) -> float:
        del bucket  # padded slots are never called
        return float(np.sum(steps))

    return CohortRunner("loop", _looped_update(program, jit, pool),
                        evaluating_every_client(evaluate_slots), evaluate_slots, computed_steps)


def _looped_update(program: CohortProgram, jit: Callable, pool: ClientThreads | None
                   ) -> Callable:
    """`CohortRunner.update` of 'loop' (`_loop_runner`), on `pool`'s threads when given."""
    # Traced once: the output shapes below and the jitted call share this trace.
    client_update = jax.jit(program.client_update)

    # Indices go in as numpy scalars and the key is picked in the program: an eager `keys[j]`
    # or `jnp.int32(...)` per participant costs more host time than the call it feeds, and
    # holds the interpreter lock the other threads need for their own calls.
    @functools.partial(jit, donate_argnums=(1, 5, 6))
    def one_client_update(broadcast, states, train, i, keys, uploads, metrics, j):
        upload, new_row, m = client_update(broadcast, get_row(states, i), get_row(train, i),
                                           keys[j])
        return (set_row(uploads, j, upload), set_row(states, i, new_row),
                set_row(metrics, j, m))

    shapes: dict = {}  # output shapes, traced once per kind (they never change)

    def update_buffers(broadcast, states, train, keys, bucket):
        # A `Finishing` broadcast adds outputs: its function is part of the shapes' key.
        kind = broadcast.fn if isinstance(broadcast, Finishing) else None
        if kind not in shapes:
            shapes[kind] = client_update.eval_shape(broadcast, row_shapes(states),
                                                    row_shapes(train), keys[0])
        uploads, _, metrics = shapes[kind]
        return zeros_in_slots((uploads, metrics), bucket)

    @jit
    def one_update(broadcast, states, train, i, keys, j):  # the threads' calls: outputs only
        return client_update(broadcast, get_row(states, i), get_row(train, i), keys[j])

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def put_update(uploads, states, metrics, i, j, outputs):
        upload, new_row, m = outputs
        return (set_row(uploads, j, upload), set_row(states, i, new_row),
                set_row(metrics, j, m))

    def update(broadcast, states, train, slots, keys):
        refuse_reducer(broadcast, "loop")
        slots = np.asarray(slots, np.int32)
        real = np.flatnonzero(slots < train.sizes.shape[0]).astype(np.int32)
        uploads, metrics = update_buffers(broadcast, states, train, keys, len(slots))
        if pool is not None and len(real):
            sizes = np.asarray(train.sizes)[slots[real]].astype(np.float64)
            outputs = pool.run("update", lambda j: one_update(
                broadcast, states, train, slots[j], keys, np.int32(j)), real, sizes)
            for j in real:
                uploads, states, metrics = put_update(uploads, states, metrics, slots[j], j,
                                                      outputs[int(j)])
            return uploads, states, metrics
        for j in real:
            uploads, states, metrics = one_client_update(
                broadcast, states, train, slots[j], keys, uploads, metrics, j)
        return uploads, states, metrics

    return update


def _looped_evaluation(program: CohortProgram, jit: Callable, pool: ClientThreads | None
                       ) -> Callable:
    """`CohortRunner.evaluate_slots` of 'loop' (`_loop_runner`), on `pool`'s threads when
    given."""
    @jit
    def one_evaluate(broadcast, states, test, i):
        return program.evaluate(broadcast, get_row(states, i), get_row(test, i))

    shape: list = []  # the metrics' shapes: the same trace as one_evaluate's first call

    @jit
    def one_global(broadcast, states, i, global_x, global_y):
        return global_accuracy(program, broadcast, get_row(states, i), global_x, global_y)

    put_evaluate = jax.jit(set_row, donate_argnums=0)

    def evaluate_slots(broadcast, states, test, slots, global_x=None, global_y=None):
        slots = np.asarray(slots, np.int32)
        real = np.flatnonzero(slots < test.sizes.shape[0]).astype(np.int32)
        if not shape:
            shape.append(one_evaluate.eval_shape(broadcast, states, test, np.int32(0)))
        out = zeros_in_slots(shape[0], len(slots))
        accuracy = None if global_x is None else zeros_in_slots(
            jax.ShapeDtypeStruct((), jnp.float32), len(slots))
        if not len(real):
            return out if accuracy is None else {**out, "global_accuracy": accuracy}
        # Unlike training, the per-client programs here take no bucket-shaped buffer, so the
        # monitoring (a round's participants) and the evaluation of every client share them.
        run = (lambda kind, call, weights: pool.run(kind, call, real, weights)) if pool else (
            lambda kind, call, weights: {int(j): call(int(j)) for j in real})
        sizes = np.asarray(test.sizes)[slots[real]].astype(np.float64)
        outputs = run("evaluate", lambda j: one_evaluate(broadcast, states, test,
                                                         slots[j]), sizes)
        for j in real:
            out = put_evaluate(out, j, outputs[int(j)])
        if accuracy is None:
            return out
        scores = run(f"global{global_x.shape}", lambda j: one_global(  # equal work per client
            broadcast, states, slots[j], global_x, global_y), np.ones(len(real)))
        for j in real:
            accuracy = put_evaluate(accuracy, j, scores[int(j)])
        return {**out, "global_accuracy": accuracy}

    return evaluate_slots


register_strategy(Strategy("loop", lambda program, o: _loop_runner(
    program, o.loop_threads, jit=o.jit)))
