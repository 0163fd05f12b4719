"""Client backbones F_k: map a batch of inputs to a feature vector z [batch, features].

Images [batch, H, W, C]:
- `cnn1` .. `cnn5`: the model zoo of the published pFedES (Yi et al., AAAI 2025; public code
  LipingYi/pFedES): conv5x5 C->16, pool, conv5x5 16->32 (CNN-2: 16), pool, fc1, fc2 (500). The
  classifier fc3 is the client's head H_k.
- `convnet3`, `convnet5`, `vit`: the three architecture groups of docs/design.md (a 3-layer CNN,
  a 5-layer CNN and a light Vision Transformer; Dosovitskiy et al., ICLR 2021).
- `convnet3_bn`: `convnet3` with BatchNorm after every conv (for FedBN; other methods refuse it).
- `cnn_small`: a 2-conv CNN (8, 16 channels, 64 features), the default shared small model of FML,
  FedKD and FedMRL on images.
Tabular [batch, F] (and small images, flattened):
- `mlp`, `mlp_small`, `mlp_deep`: perceptrons of different widths and depths.

Text [batch, L] token ids, 0 = padding:
- `embedbag`: mean of word embeddings (Joulin et al., "Bag of Tricks for Efficient Text
  Classification", EACL 2017).
- `text_cnn`: 1-D convolutions of widths 3/4/5 with max-over-time pooling (Kim, "Convolutional
  Neural Networks for Sentence Classification", EMNLP 2014).
- `text_transformer`: a 2-block Transformer encoder with learned positions and masked mean
  pooling (Vaswani et al., NeurIPS 2017).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn

from fedjax_pfedes.data.spec import InputSpec
from fedjax_pfedes.models.layers import Conv, max_pool_2x2


def normal_init(stddev: float):
    """`nn.initializers.normal(stddev)` whose values do not depend on how XLA fuses it.

    Inside jit, XLA fuses the scaling into the normal sampler and rounds the product differently
    (1 ulp) than the eager computation; the barrier keeps the two steps apart, so a jitted
    initialization gives exactly the weights an eager one does."""

    def init(key, shape, dtype=jnp.float32):
        return jax.lax.optimization_barrier(jax.random.normal(key, shape, dtype)) * stddev

    return init


def embedding_init(key, shape, dtype=jnp.float32):
    """`nn.Embed`'s default initializer (normal with variance 1 / features), made independent of
    XLA fusion like `normal_init`."""
    variance = jnp.array(1.0 / shape[-1], dtype)
    return jax.lax.optimization_barrier(jax.random.normal(key, shape, dtype)) * jnp.sqrt(variance)


class PublishedCNN(nn.Module):
    """CNN-1..CNN-5 of the published pFedES."""

    conv2_features: int
    fc1_features: int
    fc2_features: int = 500

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        x = max_pool_2x2(nn.relu(Conv(16, (5, 5), padding="VALID", name="conv1")(x)))
        x = max_pool_2x2(nn.relu(Conv(self.conv2_features, (5, 5), padding="VALID",
                                         name="conv2")(x)))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(self.fc1_features, name="fc1")(x))
        return nn.relu(nn.Dense(self.fc2_features, name="fc2")(x))


class ConvStack(nn.Module):
    """3x3 conv layers with ReLU; a 2x2 max pool follows the layers listed in `pool_after`.

    With `batch_norm`, a BatchNorm (Ioffe & Szegedy, ICML 2015) sits between each conv and its
    ReLU: `train=True` normalizes with the statistics of the real samples of the batch (`mask`
    [batch] excludes padded rows) and updates the running averages in the 'batch_stats'
    collection; `train=False` uses the running averages.
    """

    features: tuple[int, ...]
    pool_after: tuple[int, ...]
    out_features: int = 128
    batch_norm: bool = False

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool = False,
                 mask: jnp.ndarray | None = None, return_taps: bool = False):
        """Features [B, out_features]; with `return_taps`, also the globally average-pooled
        output of every conv layer (a list, first layer first)."""
        taps = []
        for i, f in enumerate(self.features):
            x = Conv(f, (3, 3), padding="SAME", name=f"conv{i + 1}")(x)
            if self.batch_norm:
                bn_mask = None if mask is None else mask.reshape(-1, 1, 1, 1)
                x = nn.BatchNorm(use_running_average=not train, momentum=0.9,
                                 name=f"bn{i + 1}")(x, mask=bn_mask)
            x = nn.relu(x)
            if i in self.pool_after and min(x.shape[-3:-1]) >= 2:
                x = max_pool_2x2(x)
            taps.append(jnp.mean(x, axis=(1, 2)))
        x = x.reshape(x.shape[0], -1)
        out = nn.relu(nn.Dense(self.out_features, name="fc")(x))
        return (out, taps) if return_taps else out


class MLP(nn.Module):
    """Flatten, then Dense+ReLU layers."""

    hidden: tuple[int, ...] = (256, 128)

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        x = x.reshape(x.shape[0], -1)
        for i, h in enumerate(self.hidden):
            x = nn.relu(nn.Dense(h, name=f"fc{i + 1}")(x))
        return x


class TransformerBlock(nn.Module):
    """Pre-LayerNorm self-attention and MLP block."""

    dim: int
    heads: int
    mlp_dim: int

    @nn.compact
    def __call__(self, x: jnp.ndarray, mask: jnp.ndarray | None = None) -> jnp.ndarray:
        y = nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(x), mask=mask)
        x = x + y
        y = nn.Dense(self.mlp_dim)(nn.LayerNorm()(x))
        return x + nn.Dense(self.dim)(nn.gelu(y))


class ViT(nn.Module):
    """A light Vision Transformer: a 4x4 grid of patches, learned positions, mean-pooled tokens."""

    dim: int = 64
    depth: int = 2
    heads: int = 4
    mlp_dim: int = 128
    grid: int = 4

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        h, w = x.shape[-3], x.shape[-2]
        patch = (max(h // self.grid, 1), max(w // self.grid, 1))
        x = Conv(self.dim, patch, strides=patch, padding="VALID", name="patch_embed")(x)
        x = x.reshape(x.shape[0], -1, self.dim)
        pos = self.param("pos_embed", normal_init(0.02), (1, x.shape[1], self.dim))
        x = x + pos
        for i in range(self.depth):
            x = TransformerBlock(self.dim, self.heads, self.mlp_dim, name=f"block{i + 1}")(x)
        return nn.LayerNorm(name="final_norm")(x).mean(axis=1)


def _token_mask(ids: jnp.ndarray) -> jnp.ndarray:
    return (ids != 0).astype(jnp.float32)[..., None]


def _masked_mean(x: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    """Mean over the token axis of the real tokens (an all-padding row gives zeros)."""
    return (x * mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)


class EmbeddingBag(nn.Module):
    """Mean of token embeddings, then Dense + ReLU."""

    vocab_size: int
    dim: int = 64
    out_features: int = 128

    @nn.compact
    def __call__(self, ids: jnp.ndarray) -> jnp.ndarray:
        e = nn.Embed(self.vocab_size, self.dim, embedding_init=embedding_init, name="embed")(ids)
        return nn.relu(nn.Dense(self.out_features, name="fc")(_masked_mean(e, _token_mask(ids))))


class TextCNN(nn.Module):
    """Convolutions over the token axis, max over the real tokens, concatenated, Dense + ReLU."""

    vocab_size: int
    dim: int = 64
    widths: tuple[int, ...] = (3, 4, 5)
    features: int = 64
    out_features: int = 128

    @nn.compact
    def __call__(self, ids: jnp.ndarray) -> jnp.ndarray:
        mask = _token_mask(ids)
        e = nn.Embed(self.vocab_size, self.dim, embedding_init=embedding_init,
                     name="embed")(ids) * mask
        pooled = []
        for w in self.widths:
            c = nn.relu(Conv(self.features, (w,), padding="SAME", name=f"conv{w}")(e))
            pooled.append(jnp.max(jnp.where(mask > 0, c, 0.0), axis=1))
        return nn.relu(nn.Dense(self.out_features, name="fc")(jnp.concatenate(pooled, -1)))


class TextTransformer(nn.Module):
    """Token embeddings + learned positions, Transformer blocks that ignore padding, masked mean."""

    vocab_size: int
    dim: int = 64
    depth: int = 2
    heads: int = 4
    mlp_dim: int = 128

    @nn.compact
    def __call__(self, ids: jnp.ndarray) -> jnp.ndarray:
        valid = ids != 0
        x = nn.Embed(self.vocab_size, self.dim, embedding_init=embedding_init, name="embed")(ids)
        x = x + self.param("pos_embed", normal_init(0.02), (1, ids.shape[1], self.dim))
        attention_mask = nn.make_attention_mask(valid, valid)
        for i in range(self.depth):
            x = TransformerBlock(self.dim, self.heads, self.mlp_dim, name=f"block{i + 1}")(
                x, attention_mask)
        return _masked_mean(nn.LayerNorm(name="final_norm")(x), _token_mask(ids))


@dataclasses.dataclass(frozen=True)
class Backbone:
    """A registered backbone: the input modalities it accepts, how to build it, and whether it
    holds BatchNorm layers (then it is called as `backbone(x, train, mask)` and carries a
    'batch_stats' collection)."""

    modalities: tuple[str, ...]
    build: Callable[[InputSpec], nn.Module]
    batch_norm: bool = False


BACKBONES: dict[str, Backbone] = {
    "cnn1": Backbone(("image",), lambda s: PublishedCNN(conv2_features=32, fc1_features=2000)),
    "cnn2": Backbone(("image",), lambda s: PublishedCNN(conv2_features=16, fc1_features=2000)),
    "cnn3": Backbone(("image",), lambda s: PublishedCNN(conv2_features=32, fc1_features=1000)),
    "cnn4": Backbone(("image",), lambda s: PublishedCNN(conv2_features=32, fc1_features=800)),
    "cnn5": Backbone(("image",), lambda s: PublishedCNN(conv2_features=32, fc1_features=500)),
    "convnet3": Backbone(("image",), lambda s: ConvStack((16, 32, 64), pool_after=(0, 1))),
    "convnet5": Backbone(("image",), lambda s: ConvStack((16, 32, 32, 64, 64),
                                                         pool_after=(0, 2))),
    "convnet3_bn": Backbone(("image",), lambda s: ConvStack((16, 32, 64), pool_after=(0, 1),
                                                            batch_norm=True), batch_norm=True),
    "cnn_small": Backbone(("image",), lambda s: ConvStack((8, 16), pool_after=(0, 1),
                                                          out_features=64)),
    "vit": Backbone(("image",), lambda s: ViT()),
    "mlp": Backbone(("image", "tabular"), lambda s: MLP(hidden=(256, 128))),
    "mlp_small": Backbone(("image", "tabular"), lambda s: MLP(hidden=(64,))),
    "mlp_deep": Backbone(("image", "tabular"), lambda s: MLP(hidden=(128, 128, 64))),
    "embedbag": Backbone(("text",), lambda s: EmbeddingBag(s.vocab_size)),
    "text_cnn": Backbone(("text",), lambda s: TextCNN(s.vocab_size)),
    "text_transformer": Backbone(("text",), lambda s: TextTransformer(s.vocab_size)),
}
BUILT_IN = frozenset(BACKBONES)


def register_architecture(name: str, module: nn.Module | Callable[[InputSpec], nn.Module], *,
                          modalities: tuple[str, ...] = ("image",),
                          batch_norm: bool = False) -> None:
    """Makes a Flax module a client backbone F_k, usable by name in
    `config.clients.architectures` (and `clients.shared_arch`) by every method.

    The module maps a batch of normalized inputs (images [B, H, W, C] in standardized units,
    tabular [B, F], text token ids [B, L]) to features z [B, f]; each method adds its own heads
    (pFedES: the projection P_k to the common space and the classifier H_k).

    Args:
      name: the name configs use; a built-in name is refused, a name registered earlier in this
        process is replaced.
      module: a `flax.linen.Module` (each client model gets a fresh copy) or a function of the
        dataset's `InputSpec` returning one (for a module that needs the input shape or the
        vocabulary size).
      modalities: the input kinds it accepts ('image', 'tabular', 'text'); checked against the
        dataset when a run starts.
      batch_norm: True if it holds BatchNorm layers: it is then called as
        `module(x, train, mask)` with a 'batch_stats' collection, and only FedBN runs it.
    """
    if name in BUILT_IN:
        raise ValueError(f"register_architecture: '{name}' is a built-in architecture; "
                         "choose another name")
    unknown = [m for m in modalities if m not in ("image", "tabular", "text")]
    if unknown or not modalities:
        raise ValueError(f"register_architecture('{name}'): modalities must be a non-empty "
                         f"subset of ('image', 'tabular', 'text'), got {modalities}")
    if isinstance(module, nn.Module):
        build = lambda spec, m=module: m.clone()  # noqa: E731
    elif callable(module):
        build = module
    else:
        raise ValueError(f"register_architecture('{name}'): module must be a flax.linen.Module "
                         f"or a function of the InputSpec, got {type(module).__name__}")
    BACKBONES[name] = Backbone(tuple(modalities), build, batch_norm)
