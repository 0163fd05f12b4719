"""On-device image augmentation inside the jitted local step.

Two recipes, written as pure JAX functions of one batch and a PRNG key, so they run inside the
compiled local step (no host round trip) and give identical numbers whether clients run by loop,
vmap or sharding: the key of a step is derived from the client's round key and the step's
position in its padded schedule, never from the strategy.

* 'crop_flip', the usual CIFAR recipe (torchvision `RandomCrop(32, padding=4)` on the raw image,
  then `RandomHorizontalFlip()`): pad 4 black pixels on each side, cut a window of the original
  size at a uniform random offset, mirror left-right with probability 1/2.
* 'flip_erase_crop', the published pFedES code's pipeline (Yi et al., AAAI 2025;
  `experiments/dataset.py`: Normalize, then RandomHorizontalFlip, RandomErasing(scale=(0.04,
  0.2), ratio=(0.5, 2)), RandomCrop(32, padding=4), all on the normalized tensor): mirror with
  probability 1/2; with probability 1/2 set a rectangle of area s * H * W (s ~ U(0.04, 0.2)) and
  aspect ratio r (log r ~ U(log 0.5, log 2)), clipped to the image, at a uniform random
  position, to 0 after normalization; then pad 4 pixels of 0 after normalization and crop.
  Since inputs are normalized inside the model here, "0 after normalization" is the dataset's
  per-channel mean in raw pixels (`fill`). torchvision redraws an erasing rectangle that does
  not fit up to 10 times and then skips; here it is clipped to the image instead.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fedjax_pfedes.errors import ConfigError

KINDS = ("none", "crop_flip", "flip_erase_crop")
PAD = 4
ERASE_P, ERASE_SCALE, ERASE_RATIO = 0.5, (0.04, 0.2), (0.5, 2.0)


def check(kind: str, modality: str) -> None:
    """ValueError naming `config.train.augment` for an unknown kind or non-image data."""
    if kind not in KINDS:
        raise ConfigError(f"config.train.augment must be one of {list(KINDS)}, got '{kind}'")
    if kind != "none" and modality != "image":
        raise ConfigError(f"config.train.augment='{kind}' is for images; this dataset is "
                         f"{modality}")


def _crop(x: jax.Array, key: jax.Array, pad_value: jax.Array | None = None) -> jax.Array:
    h, w = x.shape[0], x.shape[1]
    if pad_value is None:
        padded = jnp.pad(x, ((PAD, PAD), (PAD, PAD), (0, 0)))
    else:
        padded = jnp.broadcast_to(pad_value.astype(x.dtype),
                                  (h + 2 * PAD, w + 2 * PAD, x.shape[2]))
        padded = jax.lax.dynamic_update_slice(padded, x, (PAD, PAD, 0))
    dy, dx = jax.random.randint(key, (2,), 0, 2 * PAD + 1)
    return jax.lax.dynamic_slice(padded, (dy, dx, 0), (h, w, x.shape[2]))


def _flip(x: jax.Array, key: jax.Array) -> jax.Array:
    return jnp.where(jax.random.bernoulli(key), x[:, ::-1], x)


def _erase(x: jax.Array, key: jax.Array, fill: jax.Array) -> jax.Array:
    h, w = x.shape[0], x.shape[1]
    k_apply, k_scale, k_ratio, k_y, k_x = jax.random.split(key, 5)
    area = jax.random.uniform(k_scale, (), minval=ERASE_SCALE[0], maxval=ERASE_SCALE[1]) * h * w
    log_r = jax.random.uniform(k_ratio, (), minval=math.log(ERASE_RATIO[0]),
                               maxval=math.log(ERASE_RATIO[1]))
    eh = jnp.clip(jnp.round(jnp.sqrt(area * jnp.exp(log_r))), 1, h).astype(jnp.int32)
    ew = jnp.clip(jnp.round(jnp.sqrt(area / jnp.exp(log_r))), 1, w).astype(jnp.int32)
    top = jax.random.randint(k_y, (), 0, h - eh + 1)
    left = jax.random.randint(k_x, (), 0, w - ew + 1)
    rows, cols = jnp.arange(h)[:, None], jnp.arange(w)[None, :]
    inside = (rows >= top) & (rows < top + eh) & (cols >= left) & (cols < left + ew)
    inside &= jax.random.bernoulli(k_apply, ERASE_P)
    return jnp.where(inside[:, :, None], fill.astype(x.dtype), x)


def augment(x: jax.Array, key: jax.Array, kind: str, fill: tuple[float, ...]) -> jax.Array:
    """A batch of images [B, H, W, C] augmented example by example.

    Args:
      x: the batch, raw pixels (integers in [0, 255] or floats in [0, 1]).
      key: this step's PRNG key.
      kind: one of `KINDS`.
      fill: the erased pixels' per-channel value in [0, 1] units (the dataset's mean).

    Returns:
      The augmented batch, same shape and dtype.
    """
    if kind == "none":
        return x
    scale = 255.0 if jnp.issubdtype(x.dtype, jnp.integer) else 1.0
    value = jnp.asarray(fill, jnp.float32) * scale
    if jnp.issubdtype(x.dtype, jnp.integer):
        value = jnp.round(value)

    def one(image, k):
        k_crop, k_flip, k_erase = jax.random.split(k, 3)
        if kind == "crop_flip":
            return _flip(_crop(image, k_crop), k_flip)
        image = _erase(_flip(image, k_flip), k_erase, value)
        return _crop(image, k_crop, value)

    return jax.vmap(one)(x, jax.random.split(key, x.shape[0]))
