"""Client states and client data off the accelerator: memory that grows with participants, not N.

With `config.execution.client_states='offload'` a cohort's private client states (model,
optimizer state, step counts) live in host memory as numpy arrays — or, when all cohorts' states
exceed `config.execution.client_state_budget_gb`, in memory-mapped `.npy` files on disk — and
its local data is stored ragged (rows of all members concatenated, plus offsets) instead of
padded to [members, largest client]. Each round `OffloadedRunner` gathers only the participants'
state rows and data into a compact [bucket, ...] batch, runs the wrapped 'loop' / 'vmap' /
'shard' runner on it, and writes the new rows back. Shapes never change (always `bucket` slots,
padded to the cohort's largest client), so nothing recompiles; the numbers equal the on-device
placement's, since every client computes the same function of the same inputs.

Round cost is then O(participants) in device memory, host-device traffic and time; only
evaluation over all clients (`runner.evaluate`, every `config.eval.every` rounds) and the
host-side bookkeeping of the sampler touch every client.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfedes.algorithms.base import PyTree
from fedjax_pfedes.data.federated import ClientArrays
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.execution import slot_rows
from fedjax_pfedes.execution.strategies.protocol import CohortRunner
from fedjax_pfedes.tree_util import tree_size

PLACEMENTS = ("device", "offload")
INIT_CHUNK = 256  # clients initialized per compiled call when states are offloaded


@dataclasses.dataclass(frozen=True)
class RaggedClientArrays:
    """Samples of several clients without padding: client k's rows are
    `x[offsets[k]:offsets[k + 1]]`. `padded(idx)` builds the `ClientArrays` of some of them,
    padded to `capacity` rows (the largest client of the cohort, as the on-device layout)."""

    x: np.ndarray
    y: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    capacity: int
    step_limit: np.ndarray | None = None

    @classmethod
    def from_indices(cls, x: np.ndarray, y: np.ndarray, client_indices: list[np.ndarray]
                     ) -> RaggedClientArrays:
        sizes = np.array([len(i) for i in client_indices], np.int32)
        rows = np.concatenate(client_indices) if len(client_indices) else np.zeros(0, np.int64)
        return cls(x=x[rows], y=y[rows].astype(np.int32),
                   offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
                   sizes=sizes, capacity=max(int(sizes.max(initial=0)), 1))

    @property
    def num_clients(self) -> int:
        return int(self.sizes.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.x.nbytes + self.y.nbytes + self.offsets.nbytes + self.sizes.nbytes)

    def replace(self, **changes) -> RaggedClientArrays:
        return dataclasses.replace(self, **changes)

    def padded(self, idx: np.ndarray) -> ClientArrays:
        """The clients `idx` (clipped to the valid range), padded to `capacity` rows."""
        idx = np.clip(np.asarray(idx), 0, self.num_clients - 1)
        x = np.zeros((len(idx), self.capacity) + self.x.shape[1:], self.x.dtype)
        y = np.zeros((len(idx), self.capacity), np.int32)
        for j, k in enumerate(idx):
            lo, hi = self.offsets[k], self.offsets[k + 1]
            x[j, : hi - lo] = self.x[lo:hi]
            y[j, : hi - lo] = self.y[lo:hi]
        limit = None if self.step_limit is None else np.asarray(self.step_limit)[idx]
        return ClientArrays(x, y, self.sizes[idx], limit)


class BudgetError(ConfigError):
    """`config.execution.client_state_budget_gb` cannot hold one round's participants."""


def check_budget(row_shapes: dict[str, PyTree], members: dict[str, int],
                 buckets: dict[str, int], budget_gb: float) -> bool:
    """Whether the cohorts' states ([members] rows of `row_shapes` each) fit in `budget_gb` of
    host memory (else they go to disk). BudgetError naming the field when even one round's
    participants ([bucket] rows per cohort, which must be in memory together) do not fit."""
    row_bytes = {a: tree_size(shapes)[1] for a, shapes in row_shapes.items()}
    per_round = sum(row_bytes[a] * buckets[a] for a in row_shapes)
    budget = budget_gb * 2**30
    if per_round > budget:
        raise BudgetError(
            f"config.execution.client_state_budget_gb={budget_gb:g}: one round's participants "
            f"alone hold {per_round / 2**30:.3g} GiB of client state; raise the budget to at "
            "least that, or lower config.train.client_fraction")
    return sum(row_bytes[a] * members[a] for a in row_shapes) <= budget


def allocate(row_shapes: PyTree, members: int, directory: str | None) -> PyTree:
    """Zeroed host arrays [members, *row] for every leaf: in memory, or memory-mapped `.npy`
    files under `directory` (one per leaf, created or overwritten)."""
    leaves, treedef = jax.tree.flatten(row_shapes)
    if directory is not None:
        os.makedirs(directory, exist_ok=True)
    out = []
    for i, s in enumerate(leaves):
        shape, dtype = (members,) + tuple(s.shape), np.dtype(s.dtype)
        if directory is None:
            out.append(np.zeros(shape, dtype))
        else:
            out.append(np.lib.format.open_memmap(os.path.join(directory, f"leaf{i}.npy"),
                                                 mode="w+", dtype=dtype, shape=shape))
    return jax.tree.unflatten(treedef, out)


def initialize(init_states: Callable[[jax.Array], PyTree], ids: np.ndarray, store: PyTree,
               chunk: int = INIT_CHUNK) -> PyTree:
    """Fills `store` with `init_states(ids)` computed `chunk` clients at a time (one compiled
    shape: the last chunk is padded with repeats of its first id, and those rows dropped)."""
    chunk = max(1, min(chunk, len(ids)))
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        padded = np.concatenate([part, np.full(chunk - len(part), part[0])])
        rows = jax.device_get(init_states(jnp.asarray(padded)))
        count = len(part)
        write_rows(store, np.arange(start, start + count),
                   jax.tree.map(lambda a: a[:count], rows))  # noqa: B023 (used at once)
    jax.tree.map(release, store)
    return store


def to_host(tree: PyTree) -> PyTree:
    """Host arrays of `tree` (numpy and memory-mapped leaves as they are; device arrays copied
    into writable numpy arrays)."""
    return jax.tree.map(lambda a: a if isinstance(a, np.ndarray) else np.array(a), tree)


def refill(store: PyTree, restored: PyTree) -> PyTree:
    """`store` (host or memory-mapped arrays) overwritten with `restored` (a checkpoint's
    client states), so a resumed run keeps its states where the budget put them."""
    def copy(a, r):
        a[...] = np.asarray(r)
        release(a)
    jax.tree.map(copy, store, restored)
    return store


def _file_rows(a: np.ndarray) -> tuple[int, int, int] | None:
    """(file descriptor, byte offset of row 0, bytes per row) of a memory-mapped array whose
    rows are contiguous in its file; None for other arrays."""
    if not isinstance(a, np.memmap) or a.filename is None or not a.flags.c_contiguous:
        return None
    key = (a.filename, os.stat(a.filename).st_ino)  # a file made anew at the same path: anew
    fd = _FILES.get(key)
    if fd is None:
        fd = _FILES[key] = os.open(a.filename, os.O_RDWR)
    return fd, a.offset, a.strides[0] if a.ndim else a.itemsize


# memory-mapped store files, opened once for row reads and writes: (path, inode) -> descriptor
_FILES: dict[tuple[str, int], int] = {}


def close_files(store: PyTree) -> None:
    """Closes the descriptors row reads, writes and prefetch hints opened for the
    memory-mapped leaves of `store` (a later access opens them again). A run ends with it: an
    open descriptor keeps a removed run folder's disk space taken until the process exits, and
    a process that runs many offloaded experiments (a sweep, a notebook) would pile them up.

    Args:
      store: client-state stores (any pytree; leaves that are not memory-mapped are skipped).
    """
    names = {a.filename for a in jax.tree.leaves(store)
             if isinstance(a, np.memmap) and a.filename is not None}
    for key in [k for k in _FILES if k[0] in names]:
        os.close(_FILES.pop(key))


def read_rows(store: PyTree, idx: np.ndarray) -> PyTree:
    """Rows `idx` of every leaf, as new arrays. Memory-mapped leaves are read with one `pread`
    per row: page faults on a mapping larger than memory read it a page at a time (0.35 against
    0.14 s a round for 100,000 clients here, docs/performance.md)."""
    def read(a):
        file = _file_rows(a)
        if file is None:
            return np.asarray(a[idx])  # a copy: fancy indexing
        fd, offset, row_bytes = file
        out = np.empty((len(idx),) + a.shape[1:], a.dtype)
        for j, k in enumerate(np.asarray(idx).reshape(-1)):
            os.preadv(fd, [memoryview(out[j:j + 1]).cast("B")], offset + int(k) * row_bytes)
        return out
    return jax.tree.map(read, store)


def write_rows(store: PyTree, idx: np.ndarray, rows: PyTree) -> None:
    """Writes `rows` into rows `idx` of every leaf (memory-mapped leaves with `pwrite`)."""
    def write(a, r):
        file = _file_rows(a)
        if file is None:
            a[idx] = np.asarray(r)
            return
        fd, offset, row_bytes = file
        r = np.ascontiguousarray(np.asarray(r, a.dtype))
        for j, k in enumerate(np.asarray(idx).reshape(-1)):
            os.pwritev(fd, [memoryview(r[j:j + 1]).cast("B")], offset + int(k) * row_bytes)
    jax.tree.map(write, store, rows)


def replace_rows(store: PyTree, idx: np.ndarray, rows: PyTree) -> PyTree:
    """`store` with rows `idx` of every leaf set to `rows`: device arrays are replaced by new
    ones with the same sharding, host and memory-mapped leaves are written in place.

    Args:
      store: a client-state store (leaves stacked over the cohort's clients).
      idx: [k] local row indices.
      rows: the same tree with leaves [k, ...].

    Returns:
      The store to use from now on (the same object for host stores).
    """
    if all(not isinstance(a, jax.Array) for a in jax.tree.leaves(store)):
        write_rows(store, idx, rows)
        return store

    def put(a, r):
        if isinstance(a, jax.Array):
            return jax.device_put(a.at[np.asarray(idx)].set(np.asarray(r, a.dtype)), a.sharding)
        write_rows(a, idx, r)
        return a
    return jax.tree.map(put, store, rows)


def prefetch(store: PyTree, idx: np.ndarray) -> None:
    """Asks the kernel to start reading rows `idx` of every memory-mapped leaf into the page
    cache (`posix_fadvise(WILLNEED)`) and returns at once: a later `read_rows` of them then finds
    them in memory instead of waiting for the disk. Other leaves are already in memory. A hint
    only: the rows read are the same either way."""
    if not hasattr(os, "posix_fadvise"):  # not on macOS / Windows: nothing to hint
        return
    for a in jax.tree.leaves(store):
        file = _file_rows(a)
        if file is None:
            continue
        fd, offset, row_bytes = file
        for k in np.asarray(idx).reshape(-1):
            os.posix_fadvise(fd, offset + int(k) * row_bytes, row_bytes, os.POSIX_FADV_WILLNEED)


def release(a: np.ndarray) -> None:
    """For a memory-mapped leaf: its pages written to the file (`fsync`) and dropped from this
    process's resident memory. `initialize` and `refill` end with it, so the rounds after them
    do not compete with the write-back of every client's state."""
    if not isinstance(a, np.memmap):
        return
    a.flush()
    file = _file_rows(a)
    if file is not None:
        os.fsync(file[0])
    mapping = getattr(a, "_mmap", None)  # numpy's mmap object
    if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED)


def _data_rows(data, idx: np.ndarray) -> ClientArrays:
    if isinstance(data, RaggedClientArrays):
        return data.padded(idx)
    idx = np.clip(idx, 0, data.num_clients - 1)
    return jax.tree.map(lambda a: np.asarray(a)[idx], data)


def offloaded_runner(inner: CohortRunner, bucket: int, on_disk: bool = False) -> CohortRunner:
    """`inner` run on each round's participants only: their state rows and data are gathered
    from host (or disk) into a compact [bucket] batch, and the new rows written back.
    Evaluation over all clients runs `bucket` clients per call (the same compiled shape).
    `on_disk`: the states are memory-mapped files; the runner then has a `prefetch` (the rounds
    hint the next round's probable participants, whose rows the kernel reads meanwhile).

    The returned runner takes and returns the cohort's host states (updated in place, as the
    on-device runners donate theirs) and ragged or padded host data."""

    def compact(states, data, slots):
        slots = np.asarray(slots)
        n = data.num_clients
        valid = slots < n
        rows = np.where(valid, slots, 0)
        local = np.where(valid, np.arange(len(slots)), len(slots)).astype(np.int32)
        return rows, valid, local, jax.device_put(read_rows(states, rows)), jax.device_put(
            _data_rows(data, rows))

    def update(broadcast, states, train, slots, keys):
        states = to_host(states)
        rows, valid, local, device_states, device_train = compact(states, train, slots)
        uploads, new_states, metrics = inner.update(broadcast, device_states, device_train,
                                                    local, keys)
        write_rows(states, rows[valid], jax.tree.map(lambda a: np.asarray(a)[valid],
                                                     jax.device_get(new_states)))
        return uploads, states, metrics

    def evaluate_slots(broadcast, states, test, slots, global_x=None, global_y=None):
        _, _, local, device_states, device_test = compact(to_host(states), test, slots)
        return inner.evaluate_slots(broadcast, device_states, device_test, local, global_x,
                                    global_y)

    def evaluate(broadcast, states, test, global_x=None, global_y=None):
        return slot_rows.evaluate_in_buckets(evaluate_slots, broadcast, states, test,
                                             np.arange(test.num_clients), bucket, global_x,
                                             global_y)

    return CohortRunner(inner.strategy, update, evaluate, evaluate_slots, inner.computed_steps,
                        prefetch if on_disk else None, inner.kernels)
