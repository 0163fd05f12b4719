"""Initializations of other frameworks, applied to a Flax variables tree after `Module.init`.

PyTorch's defaults (torch.nn.Linear / Conv2d `reset_parameters`): the weight is drawn by
`kaiming_uniform_(a=sqrt(5))`, i.e. U(-b, b) with b = gain * sqrt(3 / fan_in) and
gain = sqrt(2 / (1 + a^2)) = sqrt(1/3), so b = 1 / sqrt(fan_in); the bias is U(-b, b) with the
same fan_in. fan_in is the product of all but the output dimension (in_features for a linear
layer, in_channels * kh * kw for a convolution), which in Flax's kernel layouts ([in, out] and
[kh, kw, in, out]) is the product of all but the last axis. Embeddings are N(0, 1)
(torch.nn.Embedding); normalization layers keep scale 1 and bias 0, as Flax's do.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp

STYLES = ("flax", "pytorch")


def _key(key: jax.Array, path: tuple[str, ...]) -> jax.Array:
    return jax.random.fold_in(key, zlib.crc32("/".join(path).encode()) & 0x7FFFFFFF)


def _pytorch(node, key: jax.Array, path: tuple[str, ...]):
    if not isinstance(node, dict):
        return node
    kernel = node.get("kernel")
    if kernel is not None and getattr(kernel, "ndim", 0) >= 2:
        fan_in = 1
        for n in kernel.shape[:-1]:
            fan_in *= n
        bound = 1.0 / jnp.sqrt(float(fan_in))
        out = dict(node)
        out["kernel"] = jax.random.uniform(_key(key, path + ("kernel",)), kernel.shape,
                                           kernel.dtype, -bound, bound)
        if "bias" in node:
            out["bias"] = jax.random.uniform(_key(key, path + ("bias",)), node["bias"].shape,
                                             node["bias"].dtype, -bound, bound)
        return out
    out = {}
    for name, child in node.items():
        if name == "embedding" and getattr(child, "ndim", 0) == 2:
            out[name] = jax.random.normal(_key(key, path + (name,)), child.shape, child.dtype)
        else:
            out[name] = _pytorch(child, key, path + (name,))
    return out


def reinitialize(variables: dict, key: jax.Array, style: str) -> dict:
    """`variables` (from `Module.init`) with its 'params' drawn as framework `style` does.

    Args:
      variables: a Flax variables dict ({'params': ..., other collections}).
      key: PRNG key; each parameter's draw folds in its path, so the result does not depend
        on the order of the tree.
      style: 'flax' (returned unchanged) or 'pytorch' (see the module docstring).

    Returns:
      The variables with re-drawn parameters; other collections (e.g. batch statistics) kept.
    """
    if style == "flax":
        return variables
    if style != "pytorch":
        raise ValueError(f"init style must be one of {list(STYLES)}, got '{style}'")
    return {**variables, "params": _pytorch(dict(variables["params"]), key, ("params",))}
