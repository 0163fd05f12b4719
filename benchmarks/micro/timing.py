"""The micro-benchmarks' timer."""

from __future__ import annotations

import time

import jax


def best_ms(f, *args, calls: int = 50, repeats: int = 5) -> float:
    """Milliseconds per call of `f(*args)`: the best of `repeats` runs of `calls` calls each,
    after one call that compiles (and warms) it.

    Args:
      f: a function of JAX arrays (jit it first to time the compiled program).
      *args: its arguments.
      calls: calls per run (each run ends with `jax.block_until_ready`).
      repeats: runs; the fastest counts.

    Returns:
      Milliseconds per call.
    """
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = f(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3
