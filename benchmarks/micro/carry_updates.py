"""Rare writes into a large `lax.scan` carry on XLA:CPU: which formulations copy the carry.

  python -m benchmarks.micro.carry_updates

A scan of 1,000 steps over a 200 KB running sum and a [8, 200 KB] buffer; 5 % of the steps
move a buffer row into the sum and write the step's vector in its place (what the streaming
aggregation's held uploads needed, `fedjax_pfedes/upload/streaming.py`). Prints the median of
7 calls per formulation (after one compiling call). Numbers for docs/performance.md; no
assertion anywhere.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

ROWS, STEPS, WIDTH = 8, 1000, 784 * 64


def _start():
    return jnp.zeros(WIDTH), jnp.zeros((ROWS, WIDTH))


def adds_only(xs, rare):
    def body(c, x):
        s, h = c
        return (s + x[0], h), None
    return jax.lax.scan(body, _start(), (xs, rare))[0]


def cond_row_swap(xs, rare):
    def swap(c, u):
        s, h = c
        return s + h[3], h.at[3].set(u)

    def add(c, u):
        s, h = c
        return s + u, h

    return jax.lax.scan(lambda c, x: (jax.lax.cond(x[1], swap, add, c, x[0]), None),
                        _start(), (xs, rare))[0]


def read_and_update_slice(xs, rare):
    def body(c, x):
        (s, h), (u, p) = c, x
        row = jax.lax.dynamic_index_in_dim(h, 3, keepdims=False)
        s = s + jnp.where(p, row, u)
        return (s, jax.lax.dynamic_update_index_in_dim(h, jnp.where(p, u, row), 3, 0)), None
    return jax.lax.scan(body, _start(), (xs, rare))[0]


def dropped_scatter(xs, rare):
    def body(c, x):
        (s, h), (u, p) = c, x
        s = s + jnp.where(p, 0.0, u)
        return (s, h.at[jnp.where(p, 3, ROWS)].set(u, mode="drop")), None
    return jax.lax.scan(body, _start(), (xs, rare))[0]


def main():
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.normal(size=(STEPS, WIDTH)).astype(np.float32))
    rare = jnp.asarray(rng.random(STEPS) < 0.05)
    print("| formulation (jitted) | ms per scan of 1,000 steps |")
    print("|---|---|")
    for name, fn in [("adds only (no buffer write)", adds_only),
                     ("lax.cond around the row swap", cond_row_swap),
                     ("row read + dynamic_update_slice every step", read_and_update_slice),
                     ("scatter only, index out of range unless writing", dropped_scatter)]:
        f = jax.jit(fn)
        jax.block_until_ready(f(xs, rare))
        times = []
        for _ in range(7):
            t = time.perf_counter()
            jax.block_until_ready(f(xs, rare))
            times.append(time.perf_counter() - t)
        print(f"| {name} | {np.median(times) * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
