"""Per-client norms of a stack of uploads: batched reductions against one client at a time.

  python -m benchmarks.micro.stack_reductions  # 1,000 MLP uploads (784-64-10), ~1 min
  python -m benchmarks.micro.stack_reductions --clients=100

The upload checks need each client's L2 norm of (upload - template). Written over the stack at
once, XLA:CPU reduces the whole [clients, ...] array per leaf; written per client and mapped
with `lax.map`, each client's rows are reduced while they are in cache. Prints seconds per call
(median of 5 after a compiling one) and whether each formulation matches the per-client one
bit for bit. No timed assertion anywhere: this prints numbers for docs/performance.md.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

_CLIENTS = flags.DEFINE_integer("clients", 1000, "Stacked uploads.")


def _leaves(tree):
    return jax.tree.leaves(tree)


def batched(stacked, template):
    return jnp.sqrt(sum(jnp.sum((a - t[None]).reshape(a.shape[0], -1) ** 2, axis=1)
                        for a, t in zip(_leaves(stacked), _leaves(template), strict=True)))


def batched_einsum(stacked, template):
    total = 0.0
    for a, t in zip(_leaves(stacked), _leaves(template), strict=True):
        d = (a - t[None]).reshape(a.shape[0], -1)
        total = total + jnp.einsum("ij,ij->i", d, d)
    return jnp.sqrt(total)


def vmapped_vdot(stacked, template):
    def one(upload):
        return jnp.sqrt(sum(jnp.vdot(x - t, x - t)
                            for x, t in zip(_leaves(upload), _leaves(template), strict=True)))
    return jax.vmap(one)(stacked)


def per_client(stacked, template, batch_size=None):
    def one(upload):
        return jnp.sqrt(sum(jnp.sum((x - t) ** 2)
                            for x, t in zip(_leaves(upload), _leaves(template), strict=True)))
    return jax.lax.map(one, stacked, batch_size=batch_size)


def main(argv):
    del argv
    key = jax.random.key(0)
    template = {"w1": jnp.ones((784, 64)), "b1": jnp.ones(64), "w2": jnp.ones((64, 10)),
                "b2": jnp.ones(10)}
    stacked = jax.block_until_ready(jax.tree.map(
        lambda t: jax.random.normal(key, (_CLIENTS.value,) + t.shape), template))
    size_mb = sum(a.nbytes for a in _leaves(stacked)) / 2**20
    print(f"JAX {jax.__version__} on {jax.default_backend()}: {_CLIENTS.value:,} stacked "
          f"uploads, {size_mb:.0f} MiB")
    reference = np.asarray(jax.jit(per_client)(stacked, template))
    print("| formulation (jitted) | s | equal to per-client lax.map |")
    print("|---|---|---|")
    for name, fn in [("sum over the stack", batched), ("einsum over the stack", batched_einsum),
                     ("vmap of a per-client vdot", vmapped_vdot),
                     ("lax.map per client", per_client),
                     ("lax.map, batch_size 4", lambda s, t: per_client(s, t, 4)),
                     ("lax.map, batch_size 16", lambda s, t: per_client(s, t, 16))]:
        call = jax.jit(fn)
        out = np.asarray(call(stacked, template))
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(call(stacked, template))
            times.append(time.perf_counter() - t0)
        print(f"| {name} | {np.median(times):.4f} | {bool((out == reference).all())} |",
              flush=True)


if __name__ == "__main__":
    app.run(main)
