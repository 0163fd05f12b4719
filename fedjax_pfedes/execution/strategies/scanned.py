"""The 'scan' strategy: a cohort's participants pass through one compiled `lax.scan`, one client
(or a vmapped chunk) per iteration, the stacked states as the carry; it can stream the uploads
into a reducer instead of stacking them (`upload.streaming`). On several host threads the
participants split into lanes, one scanned call each, run at the same time."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfedes.algorithms.base import CohortProgram, PyTree, global_accuracy
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.execution.host_threads import ClientThreads, balanced_groups
from fedjax_pfedes.execution.slot_rows import get_row, row_bytes, zero_padded
from fedjax_pfedes.execution.strategies.protocol import (
    UPLOAD_FACTS,
    CohortRunner,
    Finishing,
    Strategy,
    evaluating_every_client,
    register_strategy,
)
from fedjax_pfedes.tree_util import put_rows, take_rows


@dataclasses.dataclass(frozen=True)
class _Chunks:
    """How a bucket's slots pass through the scan: `size` of them per iteration (one at a time:
    the client function itself; more: vmapped over the chunk, the bucket padded out of range
    to a multiple of `size`)."""

    size: int

    def per_chunk(self, fn: Callable, in_axes: tuple) -> Callable:
        return fn if self.size == 1 else jax.vmap(fn, in_axes=in_axes)

    def chunked(self, slots: jax.Array, n: int) -> jax.Array:
        """[bucket] -> [bucket / size, size] (padded with `n`, out of range), or [bucket]."""
        if self.size == 1:
            return slots
        pad = -slots.shape[0] % self.size
        return jnp.concatenate([slots, jnp.full((pad,), n, slots.dtype)]).reshape(-1, self.size)

    def chunked_keys(self, keys: jax.Array) -> jax.Array:
        """The bucket's keys laid out as `chunked` lays out its slots (padded with key 0)."""
        if self.size == 1:
            return keys
        pad = jnp.zeros(-keys.shape[0] % self.size, jnp.int32)
        return jnp.concatenate([keys, keys[pad]]).reshape(-1, self.size)

    def unchunked(self, tree: PyTree, bucket: int) -> PyTree:
        """The scan's stacked outputs back to [bucket, ...]."""
        if self.size == 1:
            return tree
        return jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:])[:bucket], tree)

    def rows_at(self, tree: PyTree, slot: jax.Array) -> PyTree:
        return get_row(tree, slot) if self.size == 1 else take_rows(tree, slot)

    def write_rows(self, tree: PyTree, slot: jax.Array, valid: jax.Array, rows: PyTree
                   ) -> PyTree:
        """`rows` written at `slot` of the stacked `tree` where `valid` (in place when donated)."""
        if self.size > 1:
            return put_rows(tree, slot, rows)  # out-of-range slots are dropped
        i = jnp.minimum(slot, jax.tree.leaves(tree)[0].shape[0] - 1)
        return jax.tree.map(lambda a, r: jax.lax.dynamic_update_index_in_dim(
            a, jnp.where(valid, r, jax.lax.dynamic_index_in_dim(a, i, keepdims=False)), i, 0),
            tree, rows)

    def mapped(self, fn: Callable, slots: jax.Array, n: int) -> PyTree:
        """fn(slot) -> per-client pytree, over `slots`, `size` at a time; zeros where padded."""
        def one(slot):
            return zero_padded(fn(jnp.minimum(slot, n - 1)), slot < n)
        return jax.lax.map(one, slots, batch_size=self.size if self.size > 1 else None)

    def computed_steps(self, steps: np.ndarray, bucket: int) -> float:
        """`CohortRunner.computed_steps`: a chunk iterates until its longest schedule ends
        (participants fill the first slots); padded slots take no step."""
        del bucket
        if self.size == 1 or not len(steps):
            return float(np.sum(steps))
        padded = np.concatenate([steps, np.zeros(-len(steps) % self.size)]).reshape(
            -1, self.size)
        return float(self.size * padded.max(axis=1).sum())


def _scanned(client_update: Callable, chunks: _Chunks, broadcast, states, train, slots, keys,
             positions, in_place: bool):
    """One scan over `slots` (bucket positions `positions`), traced inside a jitted call.

    Returns:
      (the stacked uploads, or the reducer's final carry when `broadcast` is a `Finishing` with
      one; the states with the new rows written in place (`in_place`), or the new rows stacked;
      the stacked metrics).
    """
    n = train.sizes.shape[0]
    bucket = slots.shape[0]
    reducer = broadcast.reducer if isinstance(broadcast, Finishing) else None

    def reduce(carry, upload, metrics, sizes, position, valid):
        facts = metrics[UPLOAD_FACTS]
        template = broadcast.operand
        if chunks.size == 1:
            return reducer.add(carry, upload, facts, sizes, position, valid, template)
        return jax.lax.scan(lambda c, xs: (reducer.add(c, *xs, template), None), carry,
                            (upload, facts, sizes, position, valid))[0]

    def body(carry, xs):
        states_carry, reduced = carry
        slot, key, position = xs
        valid = slot < n
        rows = chunks.rows_at(train, slot)
        # A padded slot holds no samples, so it takes no local step.
        rows = rows.replace(sizes=jnp.where(valid, rows.sizes, 0))
        source = states_carry if in_place else states  # a lane only reads `states`
        upload, new_rows, metrics = client_update(broadcast, chunks.rows_at(source, slot), rows,
                                                  key)
        if in_place:
            states_carry = chunks.write_rows(states_carry, slot, valid, new_rows)
            new_rows = None
        if reducer is None:  # the uploads are stacked outputs
            return (states_carry, reduced), (zero_padded(upload, valid), new_rows,
                                             zero_padded(metrics, valid))
        reduced = reduce(reduced, upload, metrics, rows.sizes, position, valid)
        return (states_carry, reduced), (None, new_rows, zero_padded(metrics, valid))

    start = None if reducer is None else reducer.init(broadcast.operand)
    (states_out, reduced), (uploads, new_rows, metrics) = jax.lax.scan(
        body, (states if in_place else None, start),
        (chunks.chunked(slots, n), chunks.chunked_keys(keys), chunks.chunked(positions, bucket)))
    uploads = chunks.unchunked(uploads, bucket) if reducer is None else reduced
    return uploads, states_out if in_place else chunks.unchunked(new_rows, bucket), \
        chunks.unchunked(metrics, bucket)


class _Lanes:
    """'scan' on several host threads: a round's participants split into `threads` lanes of
    nearly equal work (dealt by their samples, `host_threads.balanced_groups`; equal sizes: slot
    positions j, j + threads, ...), each one scanned call of the same program, run at the same
    time (one scan is one thread; docs/performance.md measures what lanes gain). A lane reads
    its participants' state rows and returns their new ones, which one donated call writes back
    with the lanes' metrics (and stacked uploads) put in slot order; streamed uploads are merged
    by the reducer (`merge`). Every participant computes what it computes in one scan, so
    states, metrics and stacked uploads are equal bit for bit; a streamed sum adds the lanes'
    sums (float reassociation).

    Args:
      scanned: `_scanned` with the cohort's client update and chunks bound.
      jit: `jax.jit` with the client programs' compiler options.
      threads: the most lanes.
      budget_bytes: lanes are used when the participants' new state rows, which they stack
        (one scan writes them in place), take at most this.
    """

    def __init__(self, scanned: Callable, jit: Callable, threads: int, budget_bytes: float):
        self.threads, self.budget_bytes = threads, budget_bytes
        self.pool = ClientThreads(threads, "scan_lane")

        @jit
        def lane_update(broadcast, states, train, slots, keys, positions):
            """One lane: `keys` are the whole bucket's (the lane's picked here, in the program)."""
            keys = keys[jnp.minimum(positions, keys.shape[0] - 1)]
            return scanned(broadcast, states, train, slots, keys, positions, in_place=False)

        @functools.partial(jax.jit, donate_argnums=0)
        def put_lanes(states, lane_slots, new_rows, outputs, order):
            """The lanes' new rows written into `states`; their outputs (metrics, stacked
            uploads) concatenated and put in slot order."""
            cat = lambda trees: jax.tree.map(lambda *a: jnp.concatenate(a), *trees)  # noqa: E731
            return (put_rows(states, lane_slots.reshape(-1), cat(new_rows)),
                    jax.tree.map(lambda a: a[order], cat(outputs)))

        self.lane_update, self.put_lanes = lane_update, put_lanes

    def lanes_for(self, states, bucket: int) -> int:
        """How many lanes a bucket of `bucket` slots takes (1: one in-place scan instead)."""
        if bucket < 2 or bucket * row_bytes(states) > self.budget_bytes:
            return 1
        return min(self.threads, bucket)

    def update(self, broadcast, states, train, slots: np.ndarray, keys, lanes: int):
        """`CohortRunner.update` over `lanes` lanes."""
        bucket, n = len(slots), train.sizes.shape[0]
        # Lanes of nearly equal work: participants dealt by their samples (`balanced_groups`;
        # equal sizes deal them round-robin), padded slots last.
        weights = np.where(slots < n, np.asarray(train.sizes)[np.minimum(slots, n - 1)], 0)
        groups = balanced_groups(slots, weights.astype(np.float64), lanes,
                                 capacity=-(-bucket // lanes))
        positions, lane_positions, order = _lane_layout(tuple(map(tuple, groups)), bucket)
        lane_slots = np.where(positions < bucket, slots[np.minimum(positions, bucket - 1)],
                              n).astype(np.int32)
        done = self.pool.run("update", lambda t: self.lane_update(
            broadcast, states, train, jnp.asarray(lane_slots[t]), keys, lane_positions[t]),
            np.arange(lanes), np.ones(lanes))
        outs = [done[t] for t in range(lanes)]
        streamed = isinstance(broadcast, Finishing) and broadcast.reducer is not None
        states, (metrics, uploads) = self.put_lanes(
            states, jnp.asarray(lane_slots), [o[1] for o in outs],
            [(o[2], None if streamed else o[0]) for o in outs], order)
        if streamed:
            uploads = broadcast.reducer.merge([o[0] for o in outs])
        return uploads, states, metrics


def _scan_runner(program: CohortProgram, chunk: int = 1, jit: Callable = jax.jit,
                 threads: int = 1, lane_budget_bytes: float = 0.0) -> CohortRunner:
    """'scan': a cohort's participants pass through one compiled `lax.scan`, `chunk` of them
    per iteration (one at a time: the client function itself; more: vmapped over the chunk).

    The stacked private states are the scan's carry, updated row by row in place (the buffer is
    donated); uploads and metrics are its stacked outputs. One program per round however many
    participants: no per-client dispatch as in 'loop', and at `chunk` = 1 only one client's model
    and activations are live at a time instead of the bucket's copies of 'vmap' (a small model
    then stays in cache). Padded slots (out of range) hold no samples, take no local step, write
    nothing and return zeros. Evaluation maps the per-client programs the same way (`lax.map`).
    `jit`: `jax.jit` with the client programs' compiler options (`kernel_options`).

    With `threads` > 1 a round's participants split into that many lanes, scanned at the same
    time on host threads, with the same numbers (`_Lanes`), while their new state rows take at
    most `lane_budget_bytes`."""
    if chunk < 1:
        raise ConfigError(f"config.execution.scan_chunk must be >= 1, got {chunk}")
    chunks = _Chunks(chunk)
    scanned = functools.partial(
        _scanned, chunks.per_chunk(program.client_update, (None, 0, 0, 0)), chunks)

    @functools.partial(jit, donate_argnums=1)
    def scanned_update(broadcast, states, train, slots, keys):
        positions = jnp.arange(slots.shape[0], dtype=jnp.int32)  # slot j of the bucket
        return scanned(broadcast, states, train, slots, keys, positions, in_place=True)

    lanes = _Lanes(scanned, jit, threads, lane_budget_bytes) if threads > 1 else None

    def update(broadcast, states, train, slots, keys):
        slots = np.asarray(slots, np.int32)
        count = 1 if lanes is None else lanes.lanes_for(states, len(slots))
        if count == 1:
            return scanned_update(broadcast, states, train, jnp.asarray(slots), keys)
        return lanes.update(broadcast, states, train, slots, keys, count)

    @jit
    def scanned_evaluate_slots(broadcast, states, test, slots):
        return chunks.mapped(lambda i: program.evaluate(broadcast, get_row(states, i),
                                                        get_row(test, i)),
                             slots, test.sizes.shape[0])

    @jit
    def scanned_global_slots(broadcast, states, sizes, slots, global_x, global_y):
        return chunks.mapped(lambda i: global_accuracy(program, broadcast, get_row(states, i),
                                                       global_x, global_y),
                             slots, sizes.shape[0])

    def evaluate_slots(broadcast, states, test, slots, global_x=None, global_y=None):
        slots = jnp.asarray(slots, jnp.int32)
        metrics = scanned_evaluate_slots(broadcast, states, test, slots)
        if global_x is None:
            return metrics
        return {**metrics, "global_accuracy": scanned_global_slots(
            broadcast, states, test.sizes, slots, global_x, global_y)}

    return CohortRunner("scan", update, evaluating_every_client(evaluate_slots), evaluate_slots,
                        chunks.computed_steps)


@functools.lru_cache(maxsize=256)  # rounds of the same sizes meet the same layouts
def _lane_layout(groups: tuple[tuple[int, ...], ...], bucket: int
                 ) -> tuple[np.ndarray, tuple[jax.Array, ...], jax.Array]:
    """(bucket positions per lane [lanes, width]: lane t holds `groups[t]`, padded past the
    bucket; the same per lane on the device; for each slot position, its index in the lanes'
    concatenated outputs): the same every round of the same groups."""
    lanes, width = len(groups), -(-bucket // len(groups))
    positions = np.full((lanes, width), bucket, np.int64)
    order = np.zeros(bucket, np.int64)
    for t, group in enumerate(groups):
        positions[t, :len(group)] = group
        order[list(group)] = t * width + np.arange(len(group))
    return positions, tuple(jnp.asarray(p, jnp.int32) for p in positions), jnp.asarray(order)


register_strategy(Strategy("scan", lambda program, o: _scan_runner(
    program, o.scan_chunk, jit=o.jit, threads=o.loop_threads,
    lane_budget_bytes=o.eval_budget_bytes), streams_uploads=True))
