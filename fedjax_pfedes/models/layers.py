"""Layers shared by every model: a convolution whose gradient is fast on CPU (and whose first
layers run as a sum over their few taps there), fast max pooling and the input-normalization
layer."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn

from fedjax_pfedes.data.spec import InputSpec


def _same_or_valid_pads(n: int, k: int, s: int, padding: str) -> tuple[int, int, int]:
    """(output length, low pad, high pad) of one spatial axis, as `lax.padtype_to_pads`."""
    if padding == "SAME":
        out = -(-n // s)
        total = max((out - 1) * s + k - n, 0)
        return out, total // 2, total - total // 2
    if padding == "VALID":
        return (n - k) // s + 1, 0, 0
    raise ValueError(f"padding must be 'SAME' or 'VALID', got '{padding}'")


def _dimension_numbers(ndim: int) -> tuple[str, str, str]:
    spatial = "DHW"[-(ndim - 2):]
    return "N" + spatial + "C", spatial + "IO", "N" + spatial + "C"


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def conv(x: jnp.ndarray, kernel: jnp.ndarray, strides: tuple[int, ...], padding: str
         ) -> jnp.ndarray:
    """Channels-last convolution: x [batch, *spatial, in], kernel [*window, in, out].

    Values and gradients equal `lax.conv_general_dilated`'s (a differentiated forward pass with
    few taps, `_few_taps`, sums them in its own order: equal up to float reassociation). The
    backward pass is written as two convolutions in the forward (channels-last, [*window, in,
    out]) layout with explicit transposes. Autodiff's own backward convolutions carry transposed
    dimension labels, which XLA:CPU has no library kernel for when they sit inside a rolled loop
    (`lax.scan` / `lax.while_loop`): they fall back to a naive loop emitter, 5-10x slower
    (docs/performance.md). Canonical convolutions keep the rolled local-training loop as fast as
    an unrolled one, so the local step compiles once.
    """
    return jax.lax.conv_general_dilated(x, kernel, strides, _pads(x, kernel, strides, padding),
                                        dimension_numbers=_dimension_numbers(x.ndim))


def _pads(x, kernel, strides, padding) -> list[tuple[int, int]]:
    return [_same_or_valid_pads(x.shape[1 + d], kernel.shape[d], strides[d], padding)[1:]
            for d in range(x.ndim - 2)]


# A differentiated stride-1 convolution with at most this many (window position, input channel)
# taps is a sum of shifted inputs times a kernel row on CPU (`_tap_sum`).
MAX_TAPS = 27


def _few_taps(kernel: jnp.ndarray, strides: tuple[int, ...]) -> bool:
    """Whether `conv`'s differentiated forward pass is `_tap_sum`: on the CPU backend, every
    stride 1 and at most `MAX_TAPS` taps (a first layer on 1- or 3-channel images: 5x5x1, 3x3x3).
    XLA:CPU's convolution kernels run such layers far below their rate on wider ones (there is
    nothing to block over the input channels); one fused elementwise loop over the taps runs
    them several times faster when its output is written out, as training's backward pass needs
    it (docs/performance.md, "The first convolution"; `benchmarks.micro.first_conv`). A forward
    pass alone (evaluation) keeps XLA's kernel: there XLA fuses the sum into the pooling or
    reduction that follows, which runs slower than the kernel."""
    return (jax.default_backend() == "cpu" and all(s == 1 for s in strides)
            and math.prod(kernel.shape[:-1]) <= MAX_TAPS)


def _tap_sum(x: jnp.ndarray, kernel: jnp.ndarray, pads) -> jnp.ndarray:
    """The stride-1 convolution as sum over taps (window offset o, input channel c) of
    x_padded[o : o + out, c] * kernel[o, c, :] (equal to `lax.conv_general_dilated` up to the
    order of the float additions)."""
    nd = x.ndim - 2
    window = kernel.shape[:nd]
    xp = jnp.pad(x, ((0, 0),) + tuple(pads) + ((0, 0),))
    out_shape = [xp.shape[1 + d] - window[d] + 1 for d in range(nd)]
    total = None
    for offset in itertools.product(*(range(k) for k in window)):
        view = tuple(slice(o, o + n) for o, n in zip(offset, out_shape, strict=True))
        for c in range(x.shape[-1]):
            term = xp[(slice(None),) + view + (slice(c, c + 1),)] * kernel[offset + (c,)]
            total = term if total is None else total + term
    return total


def _conv_fwd(x, kernel, strides, padding):
    if _few_taps(kernel, strides):
        return _tap_sum(x, kernel, _pads(x, kernel, strides, padding)), (x, kernel)
    return conv(x, kernel, strides, padding), (x, kernel)


def _conv_bwd(strides, padding, residuals, dy):
    x, kernel = residuals
    nd = x.ndim - 2
    dx_pads, dk_pads = [], []
    for d in range(nd):
        n, k, s = x.shape[1 + d], kernel.shape[d], strides[d]
        out, lo, hi = _same_or_valid_pads(n, k, s, padding)
        uncovered = n + lo + hi - ((out - 1) * s + k)  # trailing inputs no window reads
        dx_pads.append((k - 1 - lo, k - 1 - hi + uncovered))
        dk_pads.append((lo, hi - uncovered))
    numbers = _dimension_numbers(x.ndim)
    # dx: full correlation of the stride-dilated dy with the flipped kernel, in and out swapped.
    flipped = jnp.swapaxes(kernel[(slice(None, None, -1),) * nd], -1, -2)
    dx = jax.lax.conv_general_dilated(dy, flipped, (1,) * nd, dx_pads, lhs_dilation=strides,
                                      dimension_numbers=numbers)
    # dkernel: the input channels play the batch, the batch plays the input channels, and dy
    # (dilated by the stride) is the window.
    x_t = jnp.moveaxis(x, (0, -1), (-1, 0))                       # [in, *spatial, batch]
    dy_t = jnp.moveaxis(dy, 0, -2)                                # [*out_spatial, batch, out]
    dk = jax.lax.conv_general_dilated(x_t, dy_t, (1,) * nd, dk_pads, rhs_dilation=strides,
                                      dimension_numbers=numbers)  # [in, *window, out]
    return dx.astype(x.dtype), jnp.moveaxis(dk, 0, -2).astype(kernel.dtype)


conv.defvjp(_conv_fwd, _conv_bwd)


class Conv(nn.Module):
    """`flax.linen.Conv` (same parameter names, shapes and initializers, so the same init) on
    `conv`, whose gradient stays fast inside rolled loops on CPU. Channels-last inputs,
    'SAME' or 'VALID' padding, no feature groups or dilation."""

    features: int
    kernel_size: Sequence[int]
    strides: Sequence[int] | None = None
    padding: str = "SAME"
    use_bias: bool = True
    kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()
    bias_init: nn.initializers.Initializer = nn.initializers.zeros_init()

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        window = tuple(self.kernel_size)
        strides = tuple(self.strides) if self.strides is not None else (1,) * len(window)
        kernel = self.param("kernel", self.kernel_init, window + (x.shape[-1], self.features))
        y = conv(x, kernel.astype(x.dtype), strides, self.padding)
        if self.use_bias:
            y = y + self.param("bias", self.bias_init, (self.features,)).astype(y.dtype)
        return y


def max_pool_2x2(x: jnp.ndarray) -> jnp.ndarray:
    """2x2 max pooling with stride 2 and 'VALID' padding, as `nn.max_pool(x, (2, 2), (2, 2))`.

    Evaluation (a forward pass not differentiated) takes a reshape and a max. Training takes the
    elementwise maximum of each window's four corners (strided slices), and a gradient of
    elementwise operations only: on XLA:CPU the autodiff gradient of the reshape and max, whose
    reductions XLA hands to separate kernels, ran up to 4x slower (and `reduce_window`'s
    slower still); in evaluation the corners ran slower than the reshape (docs/performance.md,
    "Max pooling"). Odd trailing rows/columns are dropped, as VALID pooling does. Values equal
    either way; on exact ties (a window of equal values: a constant image region after a bias
    and a ReLU) the gradient is shared equally among the tied inputs, as JAX's gradient of a
    max shares it, instead of going to one of them.
    """
    *lead, h, w, c = x.shape
    return _pool_2x2(x[..., : h // 2 * 2, : w // 2 * 2, :])


def _corners(x: jnp.ndarray) -> list[jnp.ndarray]:
    """The four positions of every 2x2 window of x [..., 2h, 2w, c], each [..., h, w, c]."""
    return [x[..., a::2, b::2, :] for a in (0, 1) for b in (0, 1)]


def _upsampled(t: jnp.ndarray) -> jnp.ndarray:
    """t [..., h, w, c] with each value repeated over its 2x2 window: [..., 2h, 2w, c]."""
    *lead, h, w, c = t.shape
    spread = jnp.broadcast_to(t[..., :, None, :, None, :], (*lead, h, 2, w, 2, c))
    return spread.reshape(*lead, 2 * h, 2 * w, c)


def _window_max(x: jnp.ndarray) -> jnp.ndarray:
    *lead, h, w, c = x.shape
    return x.reshape(*lead, h // 2, 2, w // 2, 2, c).max(axis=(-4, -2))


def _corner_max(x: jnp.ndarray) -> jnp.ndarray:
    top_left, top_right, bottom_left, bottom_right = _corners(x)
    return jnp.maximum(jnp.maximum(top_left, top_right), jnp.maximum(bottom_left, bottom_right))


@jax.custom_vjp
def _pool_2x2(x: jnp.ndarray) -> jnp.ndarray:
    return _window_max(x)


def _pool_2x2_fwd(x):
    y = _corner_max(x)
    return y, (x, y)


def _pool_2x2_bwd(saved, g):
    x, y = saved
    ties = sum((corner == y).astype(g.dtype) for corner in _corners(x))
    return (jnp.where(x == _upsampled(y), _upsampled(g / ties), jnp.zeros((), g.dtype)),)


_pool_2x2.defvjp(_pool_2x2_fwd, _pool_2x2_bwd)


class InputNormalization(nn.Module):
    """Puts every client's inputs on one scale before a network sees them.

    pFedES's proxy extractor meets data from all clients, some of which may store pixels in [0, 255]
    and others in [0, 1]; an input-normalization layer in front of E_proxy (and of every client
    model) puts them on one scale (docs/design.md). Images: integer pixels are divided by 255; for
    float pixels, each example whose maximum exceeds 1.5 is taken to be in [0, 255] and divided by
    255; then the dataset's per-channel statistics (computed from the training pool, in [0, 1]
    units) standardize it. Tabular: per-feature standardization with the pool's statistics. Text:
    token ids pass through unchanged (the embedding is part of the network). No parameters are
    learned.
    """

    spec: InputSpec

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        if self.spec.modality == "text":
            return x.astype(jnp.int32)
        if self.spec.modality == "image":
            if jnp.issubdtype(x.dtype, jnp.integer):
                x = x.astype(jnp.float32) / 255.0
            else:
                reduce_axes = tuple(range(1, x.ndim))
                in_255_range = jnp.max(x, axis=reduce_axes, keepdims=True) > 1.5
                x = jnp.where(in_255_range, x / 255.0, x)
        x = x.astype(jnp.float32)
        return (x - jnp.asarray(self.spec.mean, x.dtype)) / jnp.asarray(self.spec.std, x.dtype)
