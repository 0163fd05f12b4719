"""Host threads that run a cohort's jitted client programs at the same time: the 'loop'
strategy's per-participant calls and the 'scan' strategy's lanes (`config.execution.loop_threads`).
Every call computes what it would on one thread, so the numbers do not depend on the threads."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

import jax
import numpy as np

from fedjax_pfedes.algorithms.base import PyTree


def balanced_groups(slots: np.ndarray, weights: np.ndarray, groups: int,
                    capacity: int | None = None) -> list[np.ndarray]:
    """Positions of `slots` split into `groups` lists of nearly equal total weight (longest
    first onto the lightest list that holds fewer than `capacity` positions; ties in slot
    order), each list in ascending position order: the 'scan' strategy's lanes (of `capacity`
    slots each), one call per lane on `ClientThreads`. Equal weights deal the
    positions round-robin: list t holds t, t + groups, ..."""
    lists: list[list[int]] = [[] for _ in range(groups)]
    load = np.zeros(groups)
    for j in sorted(range(len(slots)), key=lambda j: (-weights[j], j)):
        open_ = [g for g in range(groups) if capacity is None or len(lists[g]) < capacity]
        g = min(open_, key=lambda g: (load[g], g))
        lists[g].append(j)
        load[g] += weights[j]
    return [np.asarray(sorted(g), np.int64) for g in lists]


class ClientThreads:
    """Host threads that run jitted client programs at once ('loop': one call per
    participant; 'scan': one call per lane of participants): `run` calls a function for every
    item, each thread taking the next item when its last call is done, the heaviest items
    first (a participant's time varies from call to call, so a split fixed in advance leaves a
    thread idle at the end of a round). The first call of each kind runs on the calling thread
    alone, so the threads never compile the same program at once."""

    def __init__(self, threads: int, name: str):
        self.threads = threads
        self.name = name  # the threads' name prefix
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.lock = threading.Lock()
        self.compiled: set[str] = set()

    def run(self, kind: str, call: Callable[[int], PyTree], real: np.ndarray,
            weights: np.ndarray) -> dict[int, PyTree]:
        """call(j) for every slot position j in `real` (its weight the expected cost);
        {j: output}, each output computed."""
        out: dict[int, PyTree] = {}
        todo = real
        if kind not in self.compiled or len(real) == 1:
            out[int(real[0])] = jax.block_until_ready(call(int(real[0])))
            self.compiled.add(kind)
            todo, weights = real[1:], weights[1:]
        if not len(todo):
            return out
        queue = iter(sorted(range(len(todo)), key=lambda p: (-weights[p], p)))
        taking = threading.Lock()

        def work(_) -> dict[int, PyTree]:
            done = {}
            while True:
                with taking:
                    p = next(queue, None)
                if p is None:
                    return done
                done[int(todo[p])] = jax.block_until_ready(call(int(todo[p])))

        with self.lock:
            if self.pool is None:
                self.pool = concurrent.futures.ThreadPoolExecutor(
                    self.threads, thread_name_prefix=self.name)
            for done in self.pool.map(work, range(min(self.threads, len(todo)))):
                out.update(done)
        return out
