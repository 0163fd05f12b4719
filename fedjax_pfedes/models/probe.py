"""Checks a user's registered backbone where it meets the engine: built on the dataset's
`InputSpec`, run on a probe batch, it must be a Flax module returning finite features [B, F] with
the batch axis intact. Without it a wrong output shape surfaces deep inside Flax or JAX (or, for
[1, F], broadcasts silently against the labels and trains on nonsense)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from fedjax_pfedes.data.spec import InputSpec
from fedjax_pfedes.models.backbones import BACKBONES, BUILT_IN

PROBE_BATCH = 3  # an odd size: an output with a collapsed or fixed batch axis cannot match it


def probe_inputs(spec: InputSpec, batch: int = PROBE_BATCH) -> jnp.ndarray:
    """A batch of `batch` inputs of the dataset's shape and dtype, in its normalized units
    (what a backbone receives): token ids >= 2 for text, standard normals otherwise."""
    rng = np.random.default_rng(0)
    shape = (batch,) + tuple(spec.shape)
    if spec.modality == "text":
        return jnp.asarray(rng.integers(2, max(spec.vocab_size, 3), size=shape), jnp.int32)
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def check_backbone(name: str, spec: InputSpec) -> None:
    """Raises ValueError naming the architecture, what was expected and what it returned, for a
    registered (non built-in) backbone that does not map [B, ...] inputs to finite [B, F].

    Args:
      name: a registered architecture (`register_architecture`); built-ins are not probed.
      spec: the dataset's inputs.
    """
    if name in BUILT_IN or name not in BACKBONES:
        return
    entry = BACKBONES[name]
    where = f"register_architecture('{name}')"
    try:
        module = entry.build(spec)
    except Exception as e:  # the user's factory: name it with its own message
        raise ValueError(f"{where}: building the module for {spec.modality} inputs of shape "
                         f"{tuple(spec.shape)} raised {type(e).__name__}: {e}") from None
    if not isinstance(module, nn.Module):
        raise ValueError(f"{where}: the function given as module must return a "
                         f"flax.linen.Module, returned {type(module).__name__}")
    x = probe_inputs(spec)
    args = (x, False) if entry.batch_norm else (x,)
    try:
        variables = module.init(jax.random.key(0), *args)
        out = module.apply(variables, *args, mutable=False) if not entry.batch_norm else \
            module.apply(variables, *args, mutable=["batch_stats"])[0]
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"{where}: calling the module on a probe batch of shape "
                         f"{tuple(x.shape)} raised {type(e).__name__}: {first}") from None
    if not isinstance(out, jax.Array):
        raise ValueError(f"{where}: the module must return features [B, F] (one array), "
                         f"returned {type(out).__name__} on a probe batch of shape "
                         f"{tuple(x.shape)}")
    if out.ndim != 2 or out.shape[0] != x.shape[0]:
        raise ValueError(f"{where}: the module must return features [B, F] with the batch "
                         f"axis intact; on a probe batch of shape {tuple(x.shape)} it returned "
                         f"shape {tuple(out.shape)} (expected ({x.shape[0]}, F))")
    if not bool(jnp.all(jnp.isfinite(out))):
        raise ValueError(f"{where}: the module returned non-finite features on a probe batch "
                         f"of shape {tuple(x.shape)}")
