"""FedAvg with `convnet3` written in plain JAX: the floor the engine's local update is held to.

Used by `benchmarks.compare_frameworks` (its `plain JAX` row). Shares no code with the engine:
parameters are a dict of arrays initialized here (LeCun normal kernels, zero biases, as
flax's defaults), convolutions are `lax.conv_general_dilated` (3x3, SAME, channels last),
pooling a reshape and a max, then Dense(128) + ReLU and the Dense classifier. A client's
local epoch is one jitted call: its rows shuffled by `jax.random.permutation`, its
ceil(n / B) SGD steps on the masked mean cross-entropy unrolled in the program (a client has
a handful of steps). The server's weighted sum is a jitted add per client; one host
synchronization per round. The engine's issue holds its local update to within 1.1x of this.
"""

from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np


def init_convnet3(key: jax.Array, in_ch: int, spatial: int, num_classes: int) -> dict:
    """convnet3's parameters: conv 16, 32, 64 (2x2 max pool after the first two), fc 128."""
    shapes, fan_in = {}, {}
    chans = (in_ch, 16, 32, 64)
    for i in range(3):
        shapes[f"conv{i + 1}"] = (3, 3, chans[i], chans[i + 1])
        fan_in[f"conv{i + 1}"] = 9 * chans[i]
    side = spatial // 4
    shapes["fc"], fan_in["fc"] = (side * side * 64, 128), side * side * 64
    shapes["out"], fan_in["out"] = (128, num_classes), 128
    keys = jax.random.split(key, len(shapes))
    params = {}
    for k, (name, shape) in zip(keys, shapes.items(), strict=True):
        std = math.sqrt(1.0 / fan_in[name])  # LeCun normal (truncated in flax; close enough)
        params[name] = {"w": std * jax.random.truncated_normal(k, -2.0, 2.0, shape),
                        "b": jnp.zeros(shape[-1])}
    return params


def forward(params: dict, x: jax.Array) -> jax.Array:
    for i in range(3):
        p = params[f"conv{i + 1}"]
        x = jax.lax.conv_general_dilated(x, p["w"], (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC")) + p["b"]
        x = jax.nn.relu(x)
        if i < 2:
            b, h, w, c = x.shape
            x = x[:, :h // 2 * 2, :w // 2 * 2].reshape(b, h // 2, 2, w // 2, 2, c).max((2, 4))
    x = x.reshape(x.shape[0], -1)
    x = jax.nn.relu(x @ params["fc"]["w"] + params["fc"]["b"])
    return x @ params["out"]["w"] + params["out"]["b"]


@functools.partial(jax.jit, static_argnums=(5, 6))
def local_epoch(params, x, y, n, key, batch: int, steps: int, lr: float):
    """One client's epoch: `steps` SGD steps of `batch` shuffled real rows (n of them)."""
    capacity = x.shape[0]
    order = jnp.argsort(jnp.where(jnp.arange(capacity) < n,
                                  jax.random.uniform(key, (capacity,)), 2.0))
    order = jnp.pad(order, (0, steps * batch - capacity))

    def loss(p, xb, yb, mask):
        logp = jax.nn.log_softmax(forward(p, xb))
        ce = -jnp.take_along_axis(logp, yb[:, None], axis=1)[:, 0]
        return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    for s in range(steps):  # a handful of steps: unrolled
        rows = order[s * batch:(s + 1) * batch]
        mask = (jnp.arange(s * batch, (s + 1) * batch) < n).astype(jnp.float32)
        grads = jax.grad(loss)(params, x[rows], y[rows], mask)
        params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    return params


@jax.jit
def _add_weighted(total, params, weight):
    return jax.tree.map(lambda t, p: t + weight * p, total, params)


def run_fedavg(clients: list[tuple[np.ndarray, np.ndarray]], mean, std, num_classes: int,
               rounds: int, per_round: int, batch_size: int, epochs: int, lr: float,
               seed: int = 0) -> dict:
    """FedAvg of `convnet3` over `clients` ([(x uint8 [n, H, W, C], y [n])]). Returns
    per-round wall times, the client-steps run and the set-up time before round 1."""
    if epochs != 1:
        raise ValueError(f"the plain loop runs one local epoch, got {epochs}")
    start = time.perf_counter()
    capacity = max(len(y) for _, y in clients)
    m, s = np.asarray(mean, np.float32), np.asarray(std, np.float32)
    data = []
    for x, y in clients:  # normalized once, padded to one shape (one compiled program)
        xf = x.astype(np.float32)
        xf = ((xf / 255.0 if xf.max() > 1.5 else xf) - m) / s  # uint8 images or [0, 1] floats
        pad = capacity - len(y)
        data.append((jnp.asarray(np.pad(xf, ((0, pad),) + ((0, 0),) * (xf.ndim - 1))),
                     jnp.asarray(np.pad(y.astype(np.int32), (0, pad))), len(y)))
    _, h, w, c = data[0][0].shape
    key = jax.random.key(seed)
    params = init_convnet3(key, c, h, num_classes)
    steps = math.ceil(capacity / batch_size)
    rng = np.random.default_rng(seed)
    times, client_steps = [], 0
    setup_s = time.perf_counter() - start
    for r in range(rounds):
        t0 = time.perf_counter()
        chosen = rng.choice(len(data), per_round, replace=False)
        total = jax.tree.map(jnp.zeros_like, params)
        weight = float(sum(data[k][2] for k in chosen))
        for k in chosen:
            x, y, n = data[k]
            local = local_epoch(params, x, y, n, jax.random.fold_in(key, r * len(data) + k),
                                batch_size, steps, lr)
            total = _add_weighted(total, local, jnp.float32(n / weight))
            client_steps += math.ceil(n / batch_size)
        params = total
        jax.block_until_ready(params)
        times.append(time.perf_counter() - t0)
    return {"round_s": times, "client_steps": client_steps, "setup_s": setup_s, "params": params}
