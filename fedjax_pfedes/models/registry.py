"""Maps config names to client models and proxy feature extractors.

Every client model is backbone F_k + projection head P_k + classifier head H_k (pFedES seed
document, section 2.2); its parameters are the subtrees 'backbone', 'projection', 'classifier'.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from flax import linen as nn

from fedjax_pfedes.models.backbones import BACKBONES, MLP, ConvStack
from fedjax_pfedes.models.layers import InputNormalization


class ProjectionHead(nn.Module):
    """P_k: Linear + ReLU (+ optional LayerNorm) from the private feature z to the common space."""

    dim: int
    layernorm: bool = False

    @nn.compact
    def __call__(self, z: jnp.ndarray) -> jnp.ndarray:
        e = nn.relu(nn.Dense(self.dim)(z))
        return nn.LayerNorm()(e) if self.layernorm else e


class ClientModel(nn.Module):
    """A client's private model: returns (logits = H_k(z), e_local = P_k(z)) with z = F_k(x)."""

    arch: str
    num_classes: int
    proxy_dim: int
    mean: Sequence[float]
    std: Sequence[float]
    projection_layernorm: bool = False

    def setup(self):
        self.normalize = InputNormalization(self.mean, self.std)
        self.backbone = BACKBONES[self.arch]()
        self.projection = ProjectionHead(self.proxy_dim, self.projection_layernorm)
        self.classifier = nn.Dense(self.num_classes)

    def __call__(self, x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
        z = self.backbone(self.normalize(x))
        return self.classifier(z), self.projection(z)


class ProxyExtractor(nn.Module):
    """E_proxy: input normalization, then a small backbone on the raw input, output dimension d."""

    arch: str
    dim: int
    mean: Sequence[float]
    std: Sequence[float]

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        x = InputNormalization(self.mean, self.std)(x)
        body = PROXY_BODIES[self.arch]()
        return nn.Dense(self.dim, name="out")(body(x))


PROXY_BODIES = {
    "proxy_cnn": lambda: ConvStack((16, 32, 64), pool_after=(0, 1, 2), global_average_pool=False,
                                   out_features=128),
    "proxy_mlp": lambda: MLP(hidden=(128,)),
}


def check_architecture(name: str, field: str = "config.clients.architectures") -> None:
    if name not in BACKBONES:
        raise ValueError(f"{field}: unknown model '{name}'; known: {sorted(BACKBONES)}")


def check_proxy(name: str, field: str = "config.proxy_arch") -> None:
    if name not in PROXY_BODIES:
        raise ValueError(f"{field}: unknown proxy extractor '{name}'; "
                         f"known: {sorted(PROXY_BODIES)}")


def client_model(arch: str, num_classes: int, proxy_dim: int, mean: Sequence[float],
                 std: Sequence[float], projection_layernorm: bool = False) -> ClientModel:
    """The client model for a registered backbone name."""
    check_architecture(arch)
    return ClientModel(arch, num_classes, proxy_dim, tuple(map(float, mean)),
                       tuple(map(float, std)), projection_layernorm)


def proxy_model(arch: str, dim: int, mean: Sequence[float], std: Sequence[float]
                ) -> ProxyExtractor:
    """The proxy feature extractor for a registered name."""
    check_proxy(arch)
    return ProxyExtractor(arch, dim, tuple(map(float, mean)), tuple(map(float, std)))
