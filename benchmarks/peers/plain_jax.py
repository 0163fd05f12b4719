"""FedAvg `convnet3` and pFedES CNN-1..5 in plain JAX: the floor the engine's local update is
held to.

Used by `benchmarks.peers.compare_frameworks` (its `plain JAX` row). Shares no code with the engine:
parameters are a dict of arrays initialized here (LeCun normal kernels, zero biases, as
flax's defaults), convolutions are `lax.conv_general_dilated` (3x3, SAME, channels last),
pooling a reshape and a max, then Dense(128) + ReLU and the Dense classifier. A client's
local epoch is one jitted call: its rows shuffled by `jax.random.permutation`, its
ceil(n / B) SGD steps on the masked mean cross-entropy unrolled in the program (a client has
a handful of steps). The server's weighted sum is a jitted add per client; one host
synchronization per round. pFedES (`run_pfedes`) is written the same way after
`benchmarks.peers.torch_loop.run_pfedes`: private CNN-k with classifier and projection head,
E_proxy, one proxy forward per step serving both losses, plain SGD, server momentum. The
engine's issue holds its local update to within 1.1x of these.
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


def _device_clients(clients, mean, std) -> tuple[list, int]:
    """[(x normalized float32, y int32, n)] on the device, each padded to the largest client's
    rows (one shape: one compiled program), and that row count. Images may be uint8 or [0, 1]
    floats."""
    capacity = max(len(y) for _, y in clients)
    m, s = np.asarray(mean, np.float32), np.asarray(std, np.float32)
    data = []
    for x, y in clients:
        xf = x.astype(np.float32)
        xf = ((xf / 255.0 if xf.max() > 1.5 else xf) - m) / s
        pad = capacity - len(y)
        data.append((jnp.asarray(np.pad(xf, ((0, pad),) + ((0, 0),) * (xf.ndim - 1))),
                     jnp.asarray(np.pad(y.astype(np.int32), (0, pad))), len(y)))
    return data, capacity


def run_fedavg(clients: list[tuple[np.ndarray, np.ndarray]], mean, std, num_classes: int,
               rounds: int, per_round: int, batch_size: int, epochs: int, lr: float,
               seed: int = 0) -> dict:
    """FedAvg of `convnet3` over `clients` ([(x uint8 [n, H, W, C], y [n])]). Returns
    per-round wall times, the client-steps run and the set-up time before round 1."""
    if epochs != 1:
        raise ValueError(f"the plain loop runs one local epoch, got {epochs}")
    start = time.perf_counter()
    data, capacity = _device_clients(clients, mean, std)
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


# --- pFedES with CNN-1..CNN-5 -------------------------------------------------------------------

PUBLISHED = {"cnn1": (32, 2000), "cnn2": (16, 2000), "cnn3": (32, 1000), "cnn4": (32, 800),
             "cnn5": (32, 500)}  # CNN-k: (conv2 channels, fc1 units); fc2 has 500


def _dense(key, fan_in: int, fan_out: int) -> dict:
    return {"w": math.sqrt(1.0 / fan_in) * jax.random.truncated_normal(
        key, -2.0, 2.0, (fan_in, fan_out)), "b": jnp.zeros(fan_out)}


def _conv(key, size: int, cin: int, cout: int) -> dict:
    return {"w": math.sqrt(1.0 / (size * size * cin)) * jax.random.truncated_normal(
        key, -2.0, 2.0, (size, size, cin, cout)), "b": jnp.zeros(cout)}


def _apply_conv(p: dict, x: jax.Array, padding: str) -> jax.Array:
    return jax.lax.conv_general_dilated(x, p["w"], (1, 1), padding,
                                        dimension_numbers=("NHWC", "HWIO", "NHWC")) + p["b"]


def _pool(x: jax.Array) -> jax.Array:
    b, h, w, c = x.shape
    return x[:, :h // 2 * 2, :w // 2 * 2].reshape(b, h // 2, 2, w // 2, 2, c).max((2, 4))


def init_client(key: jax.Array, arch: str, in_ch: int, spatial: int, num_classes: int,
                dim: int) -> dict:
    """CNN-k (conv 5x5 16, pool, conv 5x5 c2, pool, fc1, fc2 500), classifier H_k(z) and
    projection head P_k(z) = ReLU(Linear(z))."""
    conv2, fc1 = PUBLISHED[arch]
    side = ((spatial - 4) // 2 - 4) // 2
    k = jax.random.split(key, 6)
    return {"conv1": _conv(k[0], 5, in_ch, 16), "conv2": _conv(k[1], 5, 16, conv2),
            "fc1": _dense(k[2], side * side * conv2, fc1), "fc2": _dense(k[3], fc1, 500),
            "classifier": _dense(k[4], 500, num_classes), "projection": _dense(k[5], 500, dim)}


def client_forward(p: dict, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(logits H_k(z), projected features P_k(z)) of z = F_k(x)."""
    x = _pool(jax.nn.relu(_apply_conv(p["conv1"], x, "VALID")))
    x = _pool(jax.nn.relu(_apply_conv(p["conv2"], x, "VALID")))
    x = x.reshape(x.shape[0], -1)
    z = jax.nn.relu(jax.nn.relu(x @ p["fc1"]["w"] + p["fc1"]["b"]) @ p["fc2"]["w"]
                    + p["fc2"]["b"])
    logits = z @ p["classifier"]["w"] + p["classifier"]["b"]
    return logits, jax.nn.relu(z @ p["projection"]["w"] + p["projection"]["b"])


def init_proxy(key: jax.Array, in_ch: int, spatial: int, dim: int) -> dict:
    """E_proxy: conv 3x3 16, 32, 64 with a 2x2 pool after each, Dense(128) + ReLU, Dense(d)."""
    k = jax.random.split(key, 5)
    side = spatial // 8
    return {"conv1": _conv(k[0], 3, in_ch, 16), "conv2": _conv(k[1], 3, 16, 32),
            "conv3": _conv(k[2], 3, 32, 64), "fc": _dense(k[3], side * side * 64, 128),
            "out": _dense(k[4], 128, dim)}


def proxy_forward(q: dict, x: jax.Array) -> jax.Array:
    for name in ("conv1", "conv2", "conv3"):
        x = _pool(jax.nn.relu(_apply_conv(q[name], x, "SAME")))
    x = jax.nn.relu(x.reshape(x.shape[0], -1) @ q["fc"]["w"] + q["fc"]["b"])
    return x @ q["out"]["w"] + q["out"]["b"]


@functools.partial(jax.jit, static_argnums=(6, 7))
def pfedes_epoch(private, proxy, x, y, n, key, batch: int, steps: int, lr: float,
                 proxy_lr: float, lam: float):
    """One client's pFedES epoch: each step descends CE + lam * MSE(P_k(z), sg(E_proxy(x)))
    for the private model and MSE(E_proxy(x), sg(P_k(z))) for E_proxy (one proxy forward
    serves both; MSE is the mean over the batch's real rows and the d features)."""
    capacity = x.shape[0]
    order = jnp.argsort(jnp.where(jnp.arange(capacity) < n,
                                  jax.random.uniform(key, (capacity,)), 2.0))
    order = jnp.pad(order, (0, steps * batch - capacity))

    def mse(a, b, mask):
        return jnp.sum(jnp.mean((a - b) ** 2, axis=1) * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    for s in range(steps):
        rows = order[s * batch:(s + 1) * batch]
        mask = (jnp.arange(s * batch, (s + 1) * batch) < n).astype(jnp.float32)
        xb, yb = x[rows], y[rows]
        e_proxy, proxy_vjp = jax.vjp(lambda q, xb=xb: proxy_forward(q, xb), proxy)

        def private_loss(p, xb=xb, yb=yb, mask=mask, e_proxy=e_proxy):
            logits, e_local = client_forward(p, xb)
            logp = jax.nn.log_softmax(logits)
            ce = -jnp.take_along_axis(logp, yb[:, None], axis=1)[:, 0]
            ce = jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)
            return ce + lam * mse(e_local, jax.lax.stop_gradient(e_proxy), mask), e_local

        grads, e_local = jax.grad(private_loss, has_aux=True)(private)
        private = jax.tree.map(lambda p, g: p - lr * g, private, grads)
        d_proxy = jax.grad(lambda e, e_local=e_local, mask=mask: mse(
            e, jax.lax.stop_gradient(e_local), mask))(e_proxy)
        proxy = jax.tree.map(lambda q, g: q - proxy_lr * g, proxy, proxy_vjp(d_proxy)[0])
    return private, proxy


def run_pfedes(clients: list[tuple[np.ndarray, np.ndarray]], archs: list[str], mean, std,
               num_classes: int, rounds: int, batch_size: int, epochs: int, lr: float,
               lam: float = 0.5, dim: int = 128, proxy_lr_ratio: float = 0.1,
               server_momentum: float = 0.5, seed: int = 0) -> dict:
    """pFedES with every client each round (as `torch_loop.run_pfedes`): private CNN-k models,
    a shared E_proxy averaged by sample count with server momentum. Returns per-round wall
    times, the client-steps run and the set-up time before round 1."""
    if epochs != 1:
        raise ValueError(f"the plain loop runs one local epoch, got {epochs}")
    start = time.perf_counter()
    data, capacity = _device_clients(clients, mean, std)
    _, h, _, c = data[0][0].shape
    key = jax.random.key(seed)
    privates = [init_client(jax.random.fold_in(key, k), archs[k], c, h, num_classes, dim)
                for k in range(len(data))]
    proxy = init_proxy(jax.random.fold_in(key, len(data)), c, h, dim)
    steps = math.ceil(capacity / batch_size)
    weight = float(sum(n for _, _, n in data))
    times, client_steps = [], 0
    setup_s = time.perf_counter() - start
    for r in range(rounds):
        t0 = time.perf_counter()
        total = jax.tree.map(jnp.zeros_like, proxy)
        for k, (x, y, n) in enumerate(data):
            privates[k], local = pfedes_epoch(
                privates[k], proxy, x, y, n, jax.random.fold_in(key, r * len(data) + k),
                batch_size, steps, lr, proxy_lr_ratio * lr, lam)
            total = _add_weighted(total, local, jnp.float32(n / weight))
            client_steps += math.ceil(n / batch_size)
        proxy = jax.tree.map(lambda g, t: server_momentum * g + (1 - server_momentum) * t,
                             proxy, total)
        jax.block_until_ready(proxy)
        times.append(time.perf_counter() - t0)
    return {"round_s": times, "client_steps": client_steps, "setup_s": setup_s,
            "params": (privates, proxy)}
