"""Client backbones F_k: map inputs [batch, H, W, C] to a feature vector z [batch, features].

- `cnn1` .. `cnn5`: the model zoo of the published pFedES (Yi et al., AAAI 2025; public code
  LipingYi/pFedES): conv5x5 C->16, pool, conv5x5 16->32 (CNN-2: 16), pool, fc1, fc2 (500). The
  classifier fc3 is the client's head H_k.
- `convnet3`, `convnet5`, `vit`: the three architecture groups of the pFedES seed document (3-layer
  CNN, a 5-layer CNN and a light Vision Transformer; Dosovitskiy et al., ICLR 2021).
- `mlp`: a two-layer perceptron for small inputs.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn

from fedjax_pfedes.models.layers import max_pool_2x2


class PublishedCNN(nn.Module):
    """CNN-1..CNN-5 of the published pFedES."""

    conv2_features: int
    fc1_features: int
    fc2_features: int = 500

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        x = max_pool_2x2(nn.relu(nn.Conv(16, (5, 5), padding="VALID", name="conv1")(x)))
        x = max_pool_2x2(nn.relu(nn.Conv(self.conv2_features, (5, 5), padding="VALID",
                                         name="conv2")(x)))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(self.fc1_features, name="fc1")(x))
        return nn.relu(nn.Dense(self.fc2_features, name="fc2")(x))


class ConvStack(nn.Module):
    """3x3 conv layers with ReLU; a 2x2 max pool follows the layers listed in `pool_after`."""

    features: tuple[int, ...]
    pool_after: tuple[int, ...]
    global_average_pool: bool
    out_features: int = 128

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        for i, f in enumerate(self.features):
            x = nn.relu(nn.Conv(f, (3, 3), padding="SAME", name=f"conv{i + 1}")(x))
            if i in self.pool_after and min(x.shape[-3:-1]) >= 2:
                x = max_pool_2x2(x)
        x = x.mean(axis=(1, 2)) if self.global_average_pool else x.reshape(x.shape[0], -1)
        return nn.relu(nn.Dense(self.out_features, name="fc")(x))


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
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        y = nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(x))
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
        x = nn.Conv(self.dim, patch, strides=patch, padding="VALID", name="patch_embed")(x)
        x = x.reshape(x.shape[0], -1, self.dim)
        pos = self.param("pos_embed", nn.initializers.normal(0.02), (1, x.shape[1], self.dim))
        x = x + pos
        for i in range(self.depth):
            x = TransformerBlock(self.dim, self.heads, self.mlp_dim, name=f"block{i + 1}")(x)
        return nn.LayerNorm(name="final_norm")(x).mean(axis=1)


BACKBONES = {
    "cnn1": lambda: PublishedCNN(conv2_features=32, fc1_features=2000),
    "cnn2": lambda: PublishedCNN(conv2_features=16, fc1_features=2000),
    "cnn3": lambda: PublishedCNN(conv2_features=32, fc1_features=1000),
    "cnn4": lambda: PublishedCNN(conv2_features=32, fc1_features=800),
    "cnn5": lambda: PublishedCNN(conv2_features=32, fc1_features=500),
    "convnet3": lambda: ConvStack((16, 32, 64), pool_after=(0, 1), global_average_pool=False),
    "convnet5": lambda: ConvStack((16, 32, 32, 64, 64), pool_after=(0, 2),
                                  global_average_pool=False),
    "vit": ViT,
    "mlp": MLP,
}
