"""One local SGD step of a backbone: unrolled vs rolled loops, autodiff's conv gradient vs ours.

  python -m benchmarks.micro.local_step  # cnn1, convnet3, vit; ~1 min on 2 cores
  python -m benchmarks.micro.local_step --torch               # adds the same layers in PyTorch
  python -m benchmarks.micro.local_step --cpu_kernels=xla,eigen   # also the rolled loop on Eigen

For each backbone, 10 SGD steps of sum(F(x)^2) run as a `lax.scan` fully unrolled and rolled,
once with `flax.linen.Conv` (autodiff's backward convolutions) and once with
`fedjax_pfedes.models.layers.Conv` (backward written as canonical convolutions). Prints ms per
step (best of 3) and the compile time of the 10-step program. This is the measurement behind the
rolled local-training loop (docs/performance.md). `--cpu_kernels` times the rolled `layers.Conv`
loop compiled with each `config.execution.cpu_kernels` choice (`execution.kernel_options`).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import linen as nn

from benchmarks.micro.timing import best_ms
from fedjax_pfedes.execution import kernels
from fedjax_pfedes.models import backbones, layers

_TORCH = flags.DEFINE_bool("torch", False, "Also time the same layers in PyTorch.")
_KERNELS = flags.DEFINE_list("cpu_kernels", ["xla"], "config.execution.cpu_kernels choices the "
                             "rolled layers.Conv loop is timed with (xla, eigen).")
_STEPS = 10

WORKS = {  # backbone, input batch
    "cnn1": (lambda: backbones.PublishedCNN(32, 2000), (64, 32, 32, 3)),
    "convnet3": (lambda: backbones.ConvStack((16, 32, 64), (0, 1)), (32, 28, 28, 1)),
    "vit": (lambda: backbones.ViT(), (32, 28, 28, 1)),
}


def _jax_rows(name: str, build, shape) -> list[str]:
    rows = []
    for conv_name, conv in (("flax.linen.Conv", nn.Conv), ("layers.Conv", layers.Conv)):
        backbones.Conv = conv  # the backbones read the module-level name at call time
        model = build()
        x = jnp.ones(shape)
        params = model.init(jax.random.key(0), x)

        def loss(p, xb, model=model):
            return jnp.sum(model.apply(p, xb) ** 2)

        def step(p, xb, loss=loss):
            g = jax.grad(loss)(p, xb)
            return jax.tree.map(lambda a, b: a - 1e-3 * b, p, g), None

        xs = jnp.ones((_STEPS, *shape))
        variants = [(_STEPS, "xla"), (1, "xla")]
        if conv is layers.Conv:  # the engine's loop, with each kernel choice asked for
            variants = [(_STEPS, "xla")] + [(1, k) for k in _KERNELS.value]
        for unroll, kernel_set in variants:
            f = jax.jit(lambda p, xs, unroll=unroll, step=step:
                        jax.lax.scan(step, p, xs, unroll=unroll)[0],
                        compiler_options=kernels.kernel_options(kernel_set) or None)
            t0 = time.perf_counter()
            jax.block_until_ready(f(params, xs))
            compile_s = time.perf_counter() - t0
            ms = best_ms(f, params, xs, calls=1, repeats=3) / _STEPS
            loop = "unrolled scan" if unroll == _STEPS else "rolled scan"
            suffix = "" if kernel_set == "xla" else f", {kernel_set} kernels"
            rows.append(f"| {name} | XLA {conv_name}, {loop}{suffix} | {ms:.1f} | "
                        f"{compile_s:.1f} |")
    backbones.Conv = layers.Conv
    return rows


def _torch_row(name: str, shape) -> str:
    import torch

    from benchmarks.peers import torch_loop
    b, h, _, c = shape
    if name == "cnn1":
        model = torch_loop.PublishedCNN(c, h, 32, 2000)
    elif name == "convnet3":
        model = torch_loop.ConvStack(c, (16, 32, 64), (0, 1), h)
    else:
        return f"| {name} | PyTorch | (not written) | |"
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.ones(b, c, h, h)

    def run():
        for _ in range(_STEPS):
            opt.zero_grad(set_to_none=True)
            (model(x) ** 2).sum().backward()
            opt.step()

    run()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return f"| {name} | PyTorch {torch.__version__} ({torch.get_num_threads()} threads) | " \
           f"{best * 1e3 / _STEPS:.1f} | |"


def main(argv):
    del argv
    print(f"JAX {jax.__version__} on {jax.default_backend()}; {_STEPS} SGD steps per program")
    print("| backbone | implementation | ms/step | compile s |")
    print("|---|---|---|---|")
    for name, (build, shape) in WORKS.items():
        for r in _jax_rows(name, build, shape):
            print(r, flush=True)
        if _TORCH.value:
            print(_torch_row(name, shape), flush=True)


if __name__ == "__main__":
    app.run(main)
