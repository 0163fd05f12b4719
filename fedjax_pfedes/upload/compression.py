"""Upload compression and the size of what is actually sent (Konecny et al., "Federated Learning:
Strategies for Improving Communication Efficiency", 2016).

Every function acts on ONE client's update (a pytree) and is safe under `jax.vmap`.

- Top-k sparsification with error feedback (Stich et al., "Sparsified SGD with Memory", NeurIPS
  2018; Lin et al., "Deep Gradient Compression", ICLR 2018): the client adds its memory to the
  update, sends the k largest-magnitude coordinates of the whole update, and keeps the rest as the
  next memory, so sent + memory always equals the sum of all updates so far.
- QSGD (Alistarh et al., NeurIPS 2017): per leaf, each coordinate becomes
  ||v|| * sign(v_i) * xi_i / s with xi_i = floor(s |v_i| / ||v||) + Bernoulli(fractional part):
  unbiased, s levels.
- bf16 transport: values travel as bfloat16.

Sizes are counted from the encoded form: dense values at their dtype width; top-k as k (index,
value) pairs with 32-bit indices; QSGD as one float32 norm per leaf plus (1 sign bit +
ceil(log2(s + 1)) level bits) per transmitted coordinate.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fedjax_pfedes.config.defaults import UploadSection

# The settings every function here reads are `config.upload`'s (`UploadSection`: topk_fraction,
# value_encoding, qsgd_levels, with their ranges).


def _flatten(tree) -> tuple[jax.Array, callable]:
    leaves, treedef = jax.tree.flatten(tree)
    shapes = [(a.shape, a.dtype) for a in leaves]
    flat = jnp.concatenate([a.reshape(-1).astype(jnp.float32) for a in leaves])

    def unflatten(vector):
        out, start = [], 0
        for shape, dtype in shapes:
            size = math.prod(shape)
            out.append(vector[start:start + size].reshape(shape).astype(dtype))
            start += size
        return jax.tree.unflatten(treedef, out)

    return flat, unflatten


def tree_dim(tree) -> int:
    return sum(math.prod(a.shape) for a in jax.tree.leaves(tree))


def topk_count(dim: int, fraction: float) -> int:
    return max(1, math.ceil(fraction * dim)) if fraction < 1 else dim


def topk_with_feedback(update, memory, fraction: float):
    """(sent, new memory): the top-k coordinates of update + memory, and what was left."""
    total = jax.tree.map(lambda u, m: u.astype(jnp.float32) + m, update, memory)
    flat, unflatten = _flatten(total)
    k = topk_count(flat.shape[0], fraction)
    _, idx = jax.lax.top_k(jnp.abs(flat), k)
    sent_flat = jnp.zeros_like(flat).at[idx].set(flat[idx])
    sent, new_memory = unflatten(sent_flat), unflatten(flat - sent_flat)  # float32 leaves
    return jax.tree.map(lambda s, u: s.astype(u.dtype), sent, update), new_memory


def qsgd(update, rng: jax.Array, levels: int):
    """Unbiased stochastic quantization of every leaf to `levels` levels of its L2 norm."""
    leaves, treedef = jax.tree.flatten(update)
    keys = jax.random.split(rng, len(leaves))
    out = []
    for leaf, key in zip(leaves, keys, strict=True):
        v = leaf.astype(jnp.float32)
        norm = jnp.sqrt(jnp.sum(v ** 2))
        scaled = jnp.where(norm > 0, jnp.abs(v) / jnp.where(norm > 0, norm, 1.0) * levels, 0.0)
        lower = jnp.floor(scaled)
        xi = lower + (jax.random.uniform(key, v.shape) < scaled - lower)
        out.append((norm * jnp.sign(v) * xi / levels).astype(leaf.dtype))
    return jax.tree.unflatten(treedef, out)


def bf16_roundtrip(update):
    return jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(a.dtype), update)


def compress(update, memory, rng: jax.Array, cfg: UploadSection):
    """One client's update as the server will decode it, and the client's new memory."""
    if cfg.topk_fraction < 1:
        update, memory = topk_with_feedback(update, memory, cfg.topk_fraction)
    if cfg.value_encoding == "bf16":
        update = bf16_roundtrip(update)
    elif cfg.value_encoding == "qsgd":
        update = qsgd(update, rng, cfg.qsgd_levels)
    return update, memory


def encoded_bytes(template, cfg: UploadSection) -> float:
    """Bytes one client sends for an update shaped like `template` under `cfg`."""
    leaves = jax.tree.leaves(template)
    dim = tree_dim(template)
    sent = topk_count(dim, cfg.topk_fraction)
    if cfg.value_encoding == "qsgd":
        bits_per_value = 1 + math.ceil(math.log2(cfg.qsgd_levels + 1))
        value_bytes = sent * bits_per_value / 8 + 4 * len(leaves)
    elif cfg.value_encoding == "bf16":
        value_bytes = 2 * sent
    else:
        width = (sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in leaves)
                 / max(dim, 1))
        value_bytes = width * sent
    index_bytes = 4 * sent if cfg.topk_fraction < 1 else 0
    return float(value_bytes + index_bytes)
