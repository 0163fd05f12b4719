"""2x2 max pooling on XLA:CPU: JAX's gradient of a reshape and max against `layers.max_pool_2x2`.

  taskset -c 0 python -m benchmarks.micro.max_pool

For the pooled layers of `convnet3` (work A, the quick start) and of CNN-1..5 on MNIST, prints
ms per call (best of 5 runs of 300 calls) of: the gradient alone (`jax.vjp`'s pullback), a
ReLU, the pooling and its gradient together (what a training step runs), and the forward pass
alone (what evaluation runs), for the reshape-and-max written plainly and for
`layers.max_pool_2x2` (the corners in training, the reshape in evaluation). It checks that the
two gradients are equal bit for bit, ties included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import app

from benchmarks.micro.timing import best_ms
from fedjax_pfedes.models import layers

SHAPES = {  # layer -> the pooling's input
    "convnet3 pool 1 (32 x 28x28x16)": (32, 28, 28, 16),
    "convnet3 pool 2 (32 x 14x14x32)": (32, 14, 14, 32),
    "CNN-1..5 on MNIST pool 1 (32 x 24x24x16)": (32, 24, 24, 16),
}


def reshape_max(x):
    """The plain pooling (the shapes here are even): JAX differentiates the reshape and max
    that evaluation runs."""
    return layers._window_max(x)


def main(argv):
    del argv
    rng = np.random.default_rng(0)
    print(f"JAX {jax.__version__} on {jax.default_backend()}")
    print("| layer | pooling | gradient ms | ReLU + pool + gradient ms | forward ms |")
    print("|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        x = rng.normal(size=shape).astype(np.float32)
        x[:, : shape[1] // 4] = 0.25  # tied windows, as a constant image region gives
        x = jnp.asarray(x)
        g = jnp.asarray(rng.normal(size=reshape_max(x).shape).astype(np.float32))
        grads = {}
        for label, pool in (("reshape and max", reshape_max),
                            ("layers.max_pool_2x2", layers.max_pool_2x2)):
            def pullback(x, g, pool=pool):
                return jax.vjp(pool, x)[1](g)[0]

            def relu_pool_grad(z, g, pool=pool):
                return jax.vjp(lambda z: pool(jax.nn.relu(z)), z)[1](g)[0]

            pullback = jax.jit(pullback)
            grads[label] = pullback(x, g)
            times = (best_ms(pullback, x, g, calls=300),
                     best_ms(jax.jit(relu_pool_grad), x - 0.5, g, calls=300),
                     best_ms(jax.jit(pool), x, calls=300))
            print(f"| {name} | {label} | " + " | ".join(f"{t:.3f}" for t in times) + " |",
                  flush=True)
        first, second = grads.values()
        assert bool(jnp.all(first == second)), f"{name}: the gradients differ"


if __name__ == "__main__":
    app.run(main)
