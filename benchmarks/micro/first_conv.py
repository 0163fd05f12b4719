"""A network's first convolution (1-3 input channels) on CPU: XLA's convolution kernel against
the tap sum `models.layers.conv` runs there in training (`layers.MAX_TAPS`).

  python -m benchmarks.micro.first_conv             # ~1 min on 2 cores
  taskset -c 0 python -m benchmarks.micro.first_conv  # one core, as each 'loop' thread runs

For each layer shape, best of 5 x 50 calls, in ms: the forward pass as XLA's kernel
(`lax.conv_general_dilated`) and as the tap sum (`layers._tap_sum`, written out), and the
forward pass with the kernel's gradient (what a first layer computes in training: its input
needs no gradient) with autodiff's `lax.conv_general_dilated` and with `layers.conv` (the tap
sum where `layers._few_taps`, then the canonical backward convolution), with their ratios;
then the forward pass followed by ReLU and 2x2 max pooling, summed (an evaluation's forward
pass, where XLA fuses the sum of taps into the pooling), both ways. The last shape has more
taps than `MAX_TAPS`: `layers.conv` trains it on XLA's kernel (the control).
The measurement behind the tap sum (docs/performance.md, "The first convolution").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import app

from benchmarks.micro.timing import best_ms
from fedjax_pfedes.models import layers

SHAPES = {  # name: input [batch, H, W, C], window, output channels, padding
    "convnet3 on MNIST (work A, quick start)": ((32, 28, 28, 1), (3, 3), 16, "SAME"),
    "CNN-1..5 on MNIST (collaboration)": ((32, 28, 28, 1), (5, 5), 16, "VALID"),
    "3x3 on CIFAR": ((32, 32, 32, 3), (3, 3), 16, "SAME"),
    "CNN-1..5 on CIFAR (pFedES work; 75 taps)": ((64, 32, 32, 3), (5, 5), 16, "VALID"),
}


def _xla(padding):
    def run(x, k):
        return jax.lax.conv_general_dilated(x, k, (1, 1), layers._pads(x, k, (1, 1), padding),
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return run


def _tap_sum(padding):
    return lambda x, k: layers._tap_sum(x, k, layers._pads(x, k, (1, 1), padding))


def _ours(padding):
    return lambda x, k: layers.conv(x, k, (1, 1), padding)


def _then_pooled(f):  # an evaluation's forward pass: XLA fuses the layer into the pooling
    return lambda x, k: layers.max_pool_2x2(jax.nn.relu(f(x, k))).sum()


def _with_kernel_gradient(f):
    return lambda x, k: jax.grad(lambda k: jnp.sum(f(x, k) ** 2))(k)


def main(argv):
    del argv
    print(f"JAX {jax.__version__} on {jax.default_backend()}; ms per call, best of 5 x 50")
    print("| first layer | taps | XLA fwd | tap sum fwd | fwd speed-up | XLA fwd+dk "
          "| `layers.conv` fwd+dk | fwd+dk speed-up | XLA fwd+pool | tap sum fwd+pool |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, (shape, window, out, padding) in SHAPES.items():
        x = jax.random.normal(jax.random.key(0), shape)
        k = jax.random.normal(jax.random.key(1), window + (shape[-1], out)) * 0.1
        taps = window[0] * window[1] * shape[-1]
        xla, taps_only = jax.jit(_xla(padding)), jax.jit(_tap_sum(padding))
        f_xla, f_ours = best_ms(xla, x, k), best_ms(taps_only, x, k)
        g_xla = best_ms(jax.jit(_with_kernel_gradient(_xla(padding))), x, k)
        g_ours = best_ms(jax.jit(_with_kernel_gradient(_ours(padding))), x, k)
        p_xla = best_ms(jax.jit(_then_pooled(_xla(padding))), x, k)
        p_ours = best_ms(jax.jit(_then_pooled(_tap_sum(padding))), x, k)
        print(f"| {name} | {taps} | {f_xla:.3f} | {f_ours:.3f} | {f_xla / f_ours:.2f}x "
              f"| {g_xla:.3f} | {g_ours:.3f} | {g_xla / g_ours:.2f}x | {p_xla:.3f} "
              f"| {p_ours:.3f} |", flush=True)


if __name__ == "__main__":
    app.run(main)
