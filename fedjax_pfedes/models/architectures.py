"""Maps config names to client models and proxy feature extractors.

Every client model is input normalization + backbone F_k + projection head P_k + classifier H_k
(docs/design.md); its parameters are the subtrees 'backbone', 'projection', 'classifier'.
E_proxy is the same input normalization + a small modality-specific body: behind one
input-normalization layer, images, text and tabular features all enter the same alignment.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn

from fedjax_pfedes.data.spec import InputSpec
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.models.backbones import BACKBONES, MLP, Backbone, ConvStack, EmbeddingBag
from fedjax_pfedes.models.layers import Conv, InputNormalization


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
    spec: InputSpec
    projection_layernorm: bool = False
    projection_scales: int = 1  # > 1: one more projection head per extra E_proxy scale

    def setup(self):
        self.normalize = InputNormalization(self.spec)
        self.backbone = BACKBONES[self.arch].build(self.spec)
        self.projection = ProjectionHead(self.proxy_dim, self.projection_layernorm)
        self.scale_projections = [ProjectionHead(self.proxy_dim, self.projection_layernorm)
                                  for _ in range(self.projection_scales - 1)]
        self.classifier = nn.Dense(self.num_classes)

    def __call__(self, x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
        """(logits [B, classes], e_local [B, d]; [B, scales, d] with several scales)."""
        z = self.backbone(self.normalize(x))
        e = self.projection(z)
        if self.projection_scales > 1:
            e = jnp.stack([e] + [p(z) for p in self.scale_projections], axis=1)
        return self.classifier(z), e


class ProxyExtractor(nn.Module):
    """E_proxy: input normalization, then a small body on the raw input, output dimension d."""

    arch: str
    dim: int
    spec: InputSpec
    scales: int = 1

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """[B, d] features; with `scales` S > 1, [B, S, d]: scale 0 is the usual output, scale s
        a Dense to d of the globally pooled output of the body's s-th last conv layer (the
        multi-scale extension of the design; conv bodies only)."""
        x = InputNormalization(self.spec)(x)
        body = PROXY_BODIES[self.arch].build(self.spec)
        if self.scales == 1:
            return nn.Dense(self.dim, name="out")(body(x))
        h, taps = body(x, return_taps=True)
        outs = [nn.Dense(self.dim, name="out")(h)]
        outs += [nn.Dense(self.dim, name=f"out_scale{s}")(taps[-s])
                 for s in range(1, self.scales)]
        return jnp.stack(outs, axis=1)


PROXY_BODIES: dict[str, Backbone] = {
    "proxy_cnn": Backbone(("image",), lambda s: ConvStack((16, 32, 64), pool_after=(0, 1, 2))),
    "proxy_mlp": Backbone(("image", "tabular"), lambda s: MLP(hidden=(128,))),
    "proxy_text": Backbone(("text",), lambda s: EmbeddingBag(s.vocab_size, dim=32)),
}


def _check(registry: dict[str, Backbone], kind: str, name: str, field: str,
           modality: str | None) -> None:
    if name not in registry:
        raise ConfigError(f"{field}: unknown {kind} '{name}'; known: {sorted(registry)}")
    accepted = registry[name].modalities
    if modality is not None and modality not in accepted:
        fitting = sorted(k for k, v in registry.items() if modality in v.modalities)
        raise ConfigError(f"{field}: {kind} '{name}' takes {'/'.join(accepted)} inputs but the "
                         f"dataset is {modality}; {modality} {kind}s: {fitting}")


def check_architecture(name: str, field: str = "config.clients.architectures",
                       modality: str | None = None) -> None:
    """Raises ValueError naming `field` for an unknown backbone or one of another modality."""
    _check(BACKBONES, "model", name, field, modality)


# The small model every client shares in FML, FedKD and FedMRL, per modality.
DEFAULT_SHARED_ARCH = {"image": "cnn_small", "tabular": "mlp_small", "text": "embedbag"}


def shared_arch(name: str, spec: InputSpec, field: str = "config.clients.shared_arch") -> str:
    """`name`, or the modality's default small model when `name` is ''; checked."""
    name = name or DEFAULT_SHARED_ARCH[spec.modality]
    check_architecture(name, field, spec.modality)
    _refuse_batch_norm(name, "the shared small model", field)
    return name


def uses_batch_norm(name: str) -> bool:
    """True for backbones with BatchNorm layers (runnable with FedBN only)."""
    return BACKBONES[name].batch_norm


def _refuse_batch_norm(name: str, what: str, field: str = "config.clients.architectures"
                       ) -> None:
    if uses_batch_norm(name):
        raise ConfigError(f"{field}: '{name}' has BatchNorm layers, which "
                         f"{what} does not handle (running statistics); use it with "
                         f"config.algorithm='fedbn'")


def check_proxy(name: str, field: str = "config.proxy_arch", modality: str | None = None) -> None:
    """Raises ValueError naming `field` for an unknown proxy body or one of another modality."""
    _check(PROXY_BODIES, "proxy extractor", name, field, modality)


def client_model(arch: str, num_classes: int, proxy_dim: int, spec: InputSpec,
                 projection_layernorm: bool = False, projection_scales: int = 1) -> ClientModel:
    """The client model for a registered backbone name."""
    check_architecture(arch, modality=spec.modality)
    _refuse_batch_norm(arch, "pFedES's client model")
    return ClientModel(arch, num_classes, proxy_dim, spec, projection_layernorm,
                       projection_scales)


def proxy_scale_count(arch: str, spec: InputSpec) -> int:
    """How many scales E_proxy `arch` can emit: 1 + its conv layers (1 for other bodies)."""
    body = PROXY_BODIES[arch].build(spec)
    return 1 + len(body.features) if isinstance(body, ConvStack) else 1


def proxy_model(arch: str, dim: int, spec: InputSpec, scales: int = 1) -> ProxyExtractor:
    """The proxy feature extractor for a registered name (`scales` outputs, see
    `ProxyExtractor`)."""
    check_proxy(arch, modality=spec.modality)
    available = proxy_scale_count(arch, spec)
    if not 1 <= scales <= available:
        raise ConfigError(f"config.proxy_scales: {scales} weights, but E_proxy '{arch}' emits "
                         f"at most {available} scale(s) (1 + its conv layers)")
    return ProxyExtractor(arch, dim, spec, scales)


class Classifier(nn.Module):
    """A plain classifier H(F(x)) for methods without a projection head (FedAvg family,
    Standalone); parameter subtrees 'backbone' and 'classifier' as in `ClientModel`."""

    arch: str
    num_classes: int
    spec: InputSpec

    def setup(self):
        self.normalize = InputNormalization(self.spec)
        self.backbone = BACKBONES[self.arch].build(self.spec)
        self.classifier = nn.Dense(self.num_classes)

    def __call__(self, x: jnp.ndarray, pre_normalized: bool = False, train: bool = False,
                 mask: jnp.ndarray | None = None) -> jnp.ndarray:
        """Logits; `pre_normalized=True` skips input normalization (input already normalized,
        e.g. the output of the published pFedES's image-to-image proxy G). `train` and `mask`
        (real samples of the batch) reach BatchNorm backbones only."""
        h = x if pre_normalized else self.normalize(x)
        if BACKBONES[self.arch].batch_norm:
            return self.classifier(self.backbone(h, train, mask))
        return self.classifier(self.backbone(h))


def classifier_model(arch: str, num_classes: int, spec: InputSpec,
                     allow_batch_norm: bool = False) -> Classifier:
    """The plain classifier for a registered backbone name (BatchNorm backbones only for the
    methods that handle 'batch_stats': `allow_batch_norm=True`)."""
    check_architecture(arch, modality=spec.modality)
    if not allow_batch_norm:
        _refuse_batch_norm(arch, "this method")
    return Classifier(arch, num_classes, spec)


class ImageProxyG(nn.Module):
    """The published pFedES's shared proxy G (Yi et al., AAAI 2025): input normalization, then
    conv3x3 C->8, ReLU, conv3x3 8->C, ReLU — 443 parameters for RGB images. Returns an image in
    the normalized input space, which the client's classifier reads with `pre_normalized=True`."""

    spec: InputSpec
    hidden: int = 8

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        x = InputNormalization(self.spec)(x)
        x = nn.relu(Conv(self.hidden, (3, 3), padding="SAME", name="conv1")(x))
        return nn.relu(Conv(self.spec.shape[-1], (3, 3), padding="SAME", name="conv2")(x))


class ProjectedClassifier(nn.Module):
    """F_k, then a projection to a common dimension d, then a classifier head on it: returns
    (logits = H(e), e = P(F(x))). The head and the d-dimensional features have the same shape in
    every architecture, so heterogeneous clients can share the head (LG-FedAvg) or class
    prototypes in that space (FedProto); subtrees 'backbone', 'projection', 'classifier'."""

    arch: str
    num_classes: int
    dim: int
    spec: InputSpec

    def setup(self):
        self.normalize = InputNormalization(self.spec)
        self.backbone = BACKBONES[self.arch].build(self.spec)
        self.projection = ProjectionHead(self.dim)
        self.classifier = nn.Dense(self.num_classes)

    def __call__(self, x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
        e = self.projection(self.backbone(self.normalize(x)))
        return self.classifier(e), e


def projected_classifier(arch: str, num_classes: int, dim: int, spec: InputSpec
                         ) -> ProjectedClassifier:
    check_architecture(arch, modality=spec.modality)
    _refuse_batch_norm(arch, "the projected classifier (LG-FedAvg, FedProto, FedGH, FedKD)")
    return ProjectedClassifier(arch, num_classes, dim, spec)
